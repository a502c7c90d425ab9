"""A stage task's constructor reads, plans, fetches and loads nothing: the run manifest, the train
plan, a base drafter's download and the models are `run`'s, after the executor's done-check and
under the task lease (eyrie.tasks.executor.execute). On real Redis and a real store (a local directory)."""

import socket

import pytest

from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import RunConfig
from eyrie.data.manifest import (Counts, DatasetRef, ExtractParams, GenerateParams, Layout, RunManifest, SamplingParams,
                                 ShardManifest, ShardPlan, TargetRef, code_version, config_key, load_run_manifest,
                                 now_iso)
from eyrie.stages import TRAIN, task_kinds
from eyrie.tasks.executor import execute
from eyrie.work import keys
from eyrie.work.queue import job_state
from eyrie_extractor.plan import PlanExtract
from eyrie_extractor.shard import ExtractRunner
from eyrie_generator.plan import PlanGenerate
from eyrie_generator.shard import ShardRunner
from eyrie_trainer.plan import FetchBase, PlanTrain
from eyrie_trainer.runner import TrainRunner
from eyrie_trainer.verify import VerifyRunner
from tests.support.harness import TINY

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)

RUN = "ctor"
STAGE_TASKS = {  # every task kind's stage class with a payload of hers
    "plan-generate": (PlanGenerate, {"run": RUN}),
    "generate": (ShardRunner, {"run": RUN, "shard": 0}),
    "extract": (ExtractRunner, {"run": RUN, "shard": 1}),
    "train": (TrainRunner, {"run": RUN}),
    "plan-train": (PlanTrain, {"run": RUN}),
    "verify": (VerifyRunner, {"run": RUN}),
    "plan-extract": (PlanExtract, {"run": RUN}),
    "fetch": (FetchBase, {"run": RUN}),
}


def keep_config(store, tmp_path, run: str = RUN) -> None:
    """The run's config as `eyrie train` alone keeps it, asking a base drafter that does not exist
    (fetching it would fail)."""
    config = RunConfig(run=run, stages=["train"], target={"model": str(TINY)}, dataset={"source": "synthetic"},
                       train={"base": str(tmp_path / "no-such-base-drafter"), "epochs": 1})
    store.put_json(config_key(run), config.model_dump())


def extracted_run(store, run: str = RUN) -> None:
    """A run whose extract is finished and whose train is not planned yet: planning it now would
    fetch its base drafter."""
    layout = Layout(run)
    plans = [ShardPlan(index=0, row_start=0, row_end=3, input_key=layout.generate_input(0), input_sha256="0" * 64)]
    manifest = RunManifest(
        run=run, created_at=now_iso(), code_version=code_version(), generate_shards=plans,
        target=TargetRef(model=str(TINY), revision="r", chat_template_sha256=None, server="transformers"),
        dataset=DatasetRef(source="synthetic", kind="jsonl", revision="0" * 64, row_end=3),
        generate=GenerateParams(sampling=SamplingParams(max_tokens=16), concurrency=1, request_timeout_s=60.0,
                                max_retries=0, shard_size=3),
        extract=ExtractParams(backend="hf", aux_layers=[2, 4, 5], dtype="bf16", max_length=None, num_layers=8,
                              hidden_size=64, samples=3, tokens=48, truncated=0, projected_bytes=1, budget_bytes=None))
    store.put_json(layout.manifest, manifest.model_dump())
    samples = [{"sample_id": f"s{row}", "row": row, "status": "done", "key": layout.extract_sample(0, f"s{row}"),
                "sha256": "0" * 64, "bytes": 1, "seq_len": 16, "prompt_len": 4, "source": "template",
                "mismatch": False, "truncated": False} for row in range(3)]
    counts = Counts(total=3, done=3, tokens=48, bytes=3)
    store.put_json(layout.extract_shard_manifest(0), ShardManifest(
        run=run, stage="extract", shard=0, bytes=3, counts=counts, skip_reasons={}, failure_errors={},
        started_at=now_iso(), finished_at=now_iso(), worker=socket.gethostname(), samples=samples).model_dump())


def test_every_task_kind_is_constructed_here(store_env):  # (store_env: the module's parametrization)
    """STAGE_TASKS names every task kind of the pipeline, each with a stage class of that kind."""
    assert sorted(STAGE_TASKS) == sorted(task_kinds())
    for name, (stage_class, _) in STAGE_TASKS.items():
        assert stage_class.stage == task_kinds()[name], f"{name}: {stage_class.__name__} is another kind's"


@pytest.mark.parametrize("name", sorted(STAGE_TASKS))
def test_constructing_a_stage_task_reads_and_writes_nothing(ctx, tmp_path, name):
    """An empty store (no run manifest, no plan) and a base drafter that does not exist: the
    constructor and the done-check stand; neither the store nor Redis is touched."""
    stage_class = STAGE_TASKS[name][0]
    before = set(ctx.conn.keys())
    task = stage_class(ctx, stage_class.Payload.model_validate(STAGE_TASKS[name][1]))
    done = task.done_key()
    assert done is None or not ctx.store.exists(done)
    assert ctx.store.list("") == [] and set(ctx.conn.keys()) == before
    assert not (tmp_path / "cache").exists()  # nothing fetched, converted or materialized


@pytest.mark.parametrize("name", ["generate", "extract"])
def test_a_done_shard_returns_at_once_without_reading_the_run(ctx, tmp_path, name):
    """Its shard manifest is stored: `already_done`, the run manifest never read (none is stored)."""
    stage_class, payload = STAGE_TASKS[name]
    task = stage_class(ctx, stage_class.Payload.model_validate(payload))
    ctx.store.put_json(task.done_key(), {"done": True})
    assert execute(stage_class, payload, ctx) == {"shard": payload["shard"], "status": "already_done"}
    assert ctx.store.list("") == [task.done_key()]


def test_a_trained_run_returns_at_once_without_reading_its_plan(ctx, tmp_path):
    """The drafter's manifest is stored: `already_done`, though the run has no train plan (reading
    it first would fail the task)."""
    stage_class, payload = STAGE_TASKS["train"]
    extracted_run(ctx.store)
    ctx.store.put_json(Layout(RUN).drafter_manifest, {"done": True})
    assert execute(stage_class, payload, ctx) == {"status": "already_done"}
    assert load_run_manifest(ctx.store, RUN).train is None
    assert not (tmp_path / "cache").exists()


def test_plan_train_plans_under_the_task_lease_and_a_missing_base_is_refused_there(ctx, tmp_path):
    """The plan is made in `run` (plan-train), where fetching the missing base drafter is refused:
    the run blocked, nothing planned, no training task enqueued."""
    extracted_run(ctx.store)
    keep_config(ctx.store, tmp_path)
    result = execute(PlanTrain, {"run": RUN}, ctx)
    assert result["status"] == "refused" and "no such directory" in result["error"], result
    assert load_run_manifest(ctx.store, RUN).train is None
    assert "no such directory" in ctx.conn.get(keys.blocked(RUN)).decode()
    assert job_state(ctx.conn, TRAIN.task_id(RUN)) is None


def test_the_trainer_without_a_plan_says_how_to_make_one(ctx):
    """A train task of a run that plan-train has not planned: refused, naming `eyrie train`."""
    extracted_run(ctx.store)
    with pytest.raises(EyrieError, match="has no train plan"):
        execute(TrainRunner, {"run": RUN}, ctx)
