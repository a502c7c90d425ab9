"""What docs/architecture.md says of the code's behaviour and no other test checked, each on a real
redis-server and a file store in this process: no worker process, no model loaded.

docs/architecture.md's table "who asks the stages what", row by row, and the tests that check it:
- advance (the first stage not done is started), run_job_ids / cancel_run / retry_run (task_ids by queue)
  and run_status (status, the planners' states): test_throwaway_stage.py::
  test_a_stage_declared_in_one_class_and_one_list_entry_is_planned_run_shown_cancelled_and_retried;
  a planner's refusal in status: test_planner_tasks.py::test_a_start_alone_refused_by_its_planner_shows_in_status
- start_pipeline / start_stage: check_start, test_refused_start.py (both tests); start_alone with the
  settings given, test_planner_tasks.py::test_eyrie_train_is_planned_by_plan_train and
  test_api.py::test_one_stage_only; on_pipeline_start, here:
  test_a_pipeline_start_enqueues_the_base_drafters_fetch_only_with_a_base
- reuse (makes_states, the sections up to it): test_reuse_states.py, its first two tests
- failures and the dashboard: test_dashboard.py::test_the_dashboard_shows_failures_and_follows_a_real_run
  and ::test_tokens_per_second_over_time_from_the_progress_reports
- save_config (the sections of stages not yet planned): here,
  test_a_rerun_may_change_only_the_sections_of_stages_not_planned
- eyrie worker (queues(), needs_vllm): test_verify_stage.py, its first two tests; the demo (a worker per
  queue): test_config_and_cli.py::test_a_sigtermed_demo_stops_everything_it_started_and_named_its_server;
  the API's stage and queue parameters (startable(), queues()):
  test_architecture_doc.py::test_the_apis_stage_and_queue_parameters_are_the_stages_startable_and_queues;
  gpu_admission drain (gpu_queues()): test_k8s_jobs.py::test_a_finished_gpu_job_queues_the_jobs_of_tasks_still_waiting
"""

import re
import threading
import time

import pytest
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.runs.control import start_pipeline
from eyrie.runs.pipeline import save_config
from eyrie.stages import EXTRACT, FETCH
from eyrie.tasks.executor import ShardTask, StageTask, execute
from eyrie.work import planning
from eyrie.work import task_kinds as declared
from eyrie.work import queue as work_queue
from eyrie.work.queue import EyrieJob, enqueue, job_state, queue, task_lease, task_result
from eyrie.work.worker_loop import InProcessWorker
from tests.integration.test_refused_start import planned_run
from tests.support.harness import ROOT, tiny_run_config

FILE_STORE = pytest.mark.parametrize("store_env", ["file"], indirect=True)  # the tests on Redis and a store


def queued_ids(conn, name: str) -> list[str]:
    return queue(conn, name).job_ids


def test_every_test_this_docstring_names_is_there():
    """The tests named above for the doc's table rows exist (a renamed one is named here again)."""
    defined = {name for path in (ROOT / "tests").rglob("test_*.py")
               for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    named = set(re.findall(r"\b(test_\w+)\b(?!\.py)", __doc__))
    missing = sorted(named - defined)
    assert named and not missing, f"renamed or gone: {missing}"


@FILE_STORE
def test_a_pipeline_start_enqueues_the_base_drafters_fetch_only_with_a_base(ctx, tmp_path):
    """`eyrie.runs.control.start_pipeline` (`eyrie run`) asks each stage for `on_pipeline_start`
    ("what `eyrie run` starts ahead of it"): the train stage's fetch of a base drafter."""
    for run, train in (("based", {"base": str(tmp_path / "base-drafter")}), ("bare", {})):
        cfg = load_config(tiny_run_config(tmp_path, run, dataset={"limit": 4}, train=train))
        start_pipeline(load_settings(model=cfg.target.model), ctx.conn, ctx.store, cfg)
    assert queued_ids(ctx.conn, FETCH.queue) == [FETCH.task_id("based")]
    assert FETCH.queue == "train"


@FILE_STORE
def test_a_rerun_may_change_only_the_sections_of_stages_not_planned(ctx, tmp_path):
    """`save_config` (what a rerun may change) asks for "the `sections` of stages not yet `planned`"."""
    cfg = load_config(tiny_run_config(tmp_path, "rerun"))
    planned_run(ctx.store, "rerun", cfg.dataset.source, trained_with_lr=None)  # generated, extracted; train not planned
    save_config(ctx.conn, ctx.store, cfg)
    save_config(ctx.conn, ctx.store, cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 0.01})}))
    changed = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"layers": [1, 2, 3]})})
    with pytest.raises(EyrieError, match="differs in: extract, of stages already planned"):
        save_config(ctx.conn, ctx.store, changed)


def run_plan_probe(payload: dict) -> dict:
    """A cheap planning task: it plans nothing and says where it ran."""
    return {"status": "planned", "ran_here": payload["run"]}


@pytest.fixture
def plan_probe():
    """A planning task kind of a queue of its own, declared for this test only."""
    kind = declared.TaskKind("plan-probe", "probe", f"{__name__}.run_plan_probe")
    yield kind
    del declared._DECLARED[kind.name]


@FILE_STORE
@pytest.mark.timeout(60)  # a wait that never ran it here would hang
def test_a_planning_task_no_registered_worker_takes_in_time_runs_in_the_waiting_process(ctx, plan_probe):
    """"a worker of the stage's queue plans it; where none takes it within 10 s, [...] the command runs
    that one task itself, off the queue, as an in-process worker: `eyrie.work.planning`" (one is up here)."""
    assert planning.PICKUP_S == 10.0
    task = plan_probe.task_id("slow")
    enqueue(ctx.conn, plan_probe, {"run": "slow"})
    idle = InProcessWorker([queue(ctx.conn, plan_probe.queue)], connection=ctx.conn, serializer=JSONSerializer,
                           job_class=EyrieJob)
    idle.register_birth()  # registered on the queue, taking nothing
    try:
        started = time.monotonic()
        result = planning.await_planning(ctx.conn, plan_probe, "slow", pickup_s=0.5, poll_s=0.05, wait_s=30)
    finally:
        idle.register_death()
    assert time.monotonic() - started >= 0.5  # it gave the registered worker its pickup time first
    assert result == {"status": "planned", "ran_here": "slow"} == task_result(ctx.conn, task)
    assert job_state(ctx.conn, task) == "finished" and not queued_ids(ctx.conn, plan_probe.queue)


class Probe(StageTask):
    """A cheap task of extract's kind (only its task id is used) that records that it ran."""

    stage, Payload = EXTRACT, ShardTask
    ran = threading.Event()

    def done_key(self) -> str:
        return f"runs/{self.run_name}/probe/done.json"

    def run(self) -> dict:
        Probe.ran.set()
        self.store.put_json(self.done_key(), {"ran": True})
        return self.result("ran")


@FILE_STORE
def test_a_task_whose_lease_another_worker_holds_is_not_run(ctx, monkeypatch):
    """The executor owns "the results `already_done`, `held_by_another_worker` and `cancelled`":
    with the task lease held elsewhere, `execute` answers held_by_another_worker and runs nothing."""
    Probe.ran.clear()
    holder = task_lease(ctx.conn, EXTRACT.task_id("held", 0))
    assert holder.acquire(blocking=False)  # another worker's, live for LEASE_TTL_S (15 s)
    monkeypatch.setattr(work_queue, "LEASE_TTL_S", 0.1)  # this worker gives up after 5.1 s, not 20 s
    try:
        result = execute(Probe, {"run": "held", "shard": 0}, ctx)
    finally:
        holder.release()
    assert result == {"shard": 0, "status": "held_by_another_worker"}
    assert not Probe.ran.is_set() and not ctx.store.exists("runs/held/probe/done.json")
