"""The pipeline is data: a stage declared here, in one class (with its two tasks) and one entry in
eyrie.stages.PIPELINE, is planned, run, shown, cancelled and retried by eyrie's own advance,
status, cancel and retry, with no other file touched. Real Redis, a real store, RQ workers in this
process, the vLLM stand-in answering generate."""

import pytest
import redis
from rq.serializers import JSONSerializer

from eyrie import stages
from eyrie.core.config import load_settings
from eyrie.core.run_config import load_config
from eyrie.data.store import open_store
from eyrie.runs.control import cancel_run, retry_run, start_pipeline
from eyrie.runs.pipeline import advance, run_job_ids
from eyrie.runs.status import run_status
from eyrie.stages import PipelineStage, RunView, TaskKind
from eyrie.tasks.executor import StageTask, execute
from eyrie.work.queue import EyrieJob, job_state, queue
from eyrie.work.status_models import StageStatus
from eyrie.work.worker_loop import InProcessWorker
from tests.support.harness import tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
PLAN_NOTE = TaskKind("plan-note", "note", f"{__name__}.run_plan_note")  # the workers import them by this path
NOTE = TaskKind("note", "note", f"{__name__}.run_note")


class Note(PipelineStage):
    """After generate: plans a count of the generated shards, then writes one note per run."""

    name = queue = worker = "note"
    planner, work = PLAN_NOTE, NOTE

    def planned(self, view: RunView) -> bool:
        return view.store.exists(f"{view.layout.root}/note/plan.json")

    def done(self, view: RunView) -> bool:
        return view.store.exists(f"{view.layout.root}/note/done.json")


class PlanNoteTask(StageTask):
    stage = PLAN_NOTE

    def run(self) -> dict:
        shards = len(self.store.get_json(f"runs/{self.run_name}/manifest.json")["generate_shards"])
        self.store.put_json(f"runs/{self.run_name}/note/plan.json", {"shards": shards})
        return self.result("planned", shards=shards)


class NoteTask(StageTask):
    stage = NOTE

    def done_key(self) -> str:
        return f"runs/{self.run_name}/note/done.json"

    def run(self) -> dict:
        self.write_manifest(StageStatus(state="done", total=1, done=1))
        return self.result("done")


def run_plan_note(payload: dict) -> dict:
    return execute(PlanNoteTask, payload)


def run_note(payload: dict) -> dict:
    return execute(NoteTask, payload)


def work(conn, name: str) -> None:
    InProcessWorker([queue(conn, name)], connection=conn, serializer=JSONSerializer,
                    job_class=EyrieJob).work(burst=True)


@pytest.fixture
def note_stage():
    """The one list entry: the note after generate."""
    stages.PIPELINE.insert(1, Note())
    yield
    del stages.PIPELINE[1]


def test_a_stage_declared_in_one_class_and_one_list_entry_is_planned_run_shown_cancelled_and_retried(
        env, stub_server, tmp_path, monkeypatch, note_stage):
    monkeypatch.setenv("EYRIE_INFERENCE_URL", stub_server(tokens=4))
    monkeypatch.setenv("EYRIE_SERVER", "vllm")
    cfg = load_config(tiny_run_config(tmp_path, "n", dataset={"limit": 4}, generate={"shard_size": 2}))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)

    assert "note" in stages.queues() and f"{__name__}.run_note" in stages.task_funcs()
    start_pipeline(settings, conn, store, cfg)
    work(conn, "generate")  # each finished task advances the run: generate done -> the note's planner
    assert job_state(conn, PLAN_NOTE.task_id("n")) == "queued"
    assert run_job_ids(store, "n")["note"] == ["plan-note-n-00000", "note-n-00000"]

    work(conn, "note")  # planned; its planner's success enqueued its work task, which ran too
    assert store.get_json("runs/n/note/plan.json") == {"shards": 2}
    status = run_status(conn, store, "n")
    assert list(status.stages) == ["generate", "note"] and status.stages["note"].state == "done"
    assert status.pipeline.tasks["plan-note"].state == "finished"
    assert job_state(conn, stages.PLAN_EXTRACT.task_id("n")) == "queued"  # the pipeline went on past it

    store.delete("runs/n/note/done.json")  # its output gone: the note is to be done again
    assert advance(conn, store, "n") == "note" and job_state(conn, NOTE.task_id("n")) == "queued"
    assert run_status(conn, store, "n").stages["note"].state == "in_progress"
    cancelled = cancel_run(conn, store, "n")
    assert NOTE.task_id("n") in cancelled["cancelled"]
    assert run_status(conn, store, "n").stages["note"].state == "cancelled"

    retried = retry_run(conn, store, "n")
    assert NOTE.task_id("n") in retried["requeued"]
    work(conn, "note")
    assert store.exists("runs/n/note/done.json")
    assert run_status(conn, store, "n").stages["note"].state == "done"
