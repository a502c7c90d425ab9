"""The planning tasks (plan-extract, plan-train) and the base drafter's fetch, run in this process
through the one executor (eyrie.tasks.executor.execute) on real Redis and a real store: what they
plan from (the settings a start alone sends, else the kept run config), their results, a refusal
blocking the run, payloads with more than the run and its settings refused before anything runs;
and `eyrie train --run R --lr` planned by plan-train."""

import subprocess
import sys

import pytest
from pydantic import ValidationError
from rq.serializers import JSONSerializer

from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import TrainSettings
from eyrie.data.manifest import Layout, config_key, load_run_manifest
from eyrie.stages.run_config import stored_config
from eyrie.runs.control import await_planned, start_stage
from eyrie.runs.pipeline import save_config, stage_config
from eyrie.runs.status import run_status
from eyrie.stages import PLAN_EXTRACT, PLAN_TRAIN, TRAIN
from eyrie.stages.train import Train
from eyrie.tasks.executor import Context, execute
from eyrie.work import keys
from eyrie.work.queue import EyrieJob, job_state
from eyrie_extractor.plan import PlanExtract
from eyrie_trainer.plan import FetchBase, PlanTrain
from tests.support.harness import TINY, eyrie_in_process, tiny_run_config
from tests.support.legacy_drafter import build_legacy_drafter
from tests.unit.test_stage_constructors import extracted_run

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)


def pipeline(ctx: Context, tmp_path, run: str, **sections) -> None:
    save_config(ctx.conn, ctx.store, load_config(tiny_run_config(tmp_path, run, **sections)))


def blocked(ctx: Context, run: str) -> str | None:
    text = ctx.conn.get(keys.blocked(run))
    return text.decode() if text else None


def test_fetch_without_a_base_has_nothing_to_do(ctx, tmp_path):
    pipeline(ctx, tmp_path, "nobase")
    assert execute(FetchBase, {"run": "nobase"}, ctx) == {"status": "no_base"}
    assert execute(FetchBase, {"run": "no-pipeline"}, ctx) == {"status": "no_base"}


def test_fetch_readies_a_fitting_base_and_blocks_the_run_on_one_that_does_not_fit(ctx, tmp_path):
    legacy = build_legacy_drafter(tmp_path / "legacy", TINY)
    pipeline(ctx, tmp_path, "fits", train={"base": str(legacy)})
    ready = execute(FetchBase, {"run": "fits"}, ctx)
    assert ready["status"] == "ready" and ready["legacy"] and ready["aux_layers"] == [2, 4, 5], ready
    assert ready["path"].startswith(str(tmp_path / "cache" / "base")) and blocked(ctx, "fits") is None

    narrow = build_legacy_drafter(tmp_path / "narrow", TINY, hidden_size=32)
    pipeline(ctx, tmp_path, "misfit", train={"base": str(narrow)})
    refused = execute(FetchBase, {"run": "misfit"}, ctx)
    assert refused["status"] == "refused" and "hidden size 32 (base) vs 64 (target)" in refused["error"]
    assert "hidden size 32 (base) vs 64 (target)" in blocked(ctx, "misfit")


def test_plan_extract_refused_blocks_the_run(ctx, tmp_path):
    pipeline(ctx, tmp_path, "unplanned")  # a config kept, no run manifest: nothing generated to plan from
    result = execute(PlanExtract, {"run": "unplanned"}, ctx)
    assert result["run"] == "unplanned" and result["status"] == "refused" and "unknown run" in result["error"]
    assert f"{result['error']} Fix: {result['fix']}" == blocked(ctx, "unplanned")


def train_alone(ctx: Context, run: str, **given) -> None:
    """The config `eyrie train --run RUN` keeps: the run's, naming train, with the settings given."""
    save_config(ctx.conn, ctx.store, stage_config(ctx.settings, ctx.store, run, Train(), TrainSettings(**given)))


def test_plan_train_plans_from_the_settings_given_and_enqueues_training(ctx):
    """A start alone keeps the settings given in the run's config: the plan has them; the training
    task carries the run alone."""
    extracted_run(ctx.store, "given")
    train_alone(ctx, "given", lr=0.002, seq_len=256)
    assert stored_config(ctx.store, "given").stages == ["train"]
    result = execute(PlanTrain, {"run": "given"}, ctx)
    assert result == {"run": "given", "status": "planned", "train_samples": 2, "enqueued": 1}
    assert load_run_manifest(ctx.store, "given").train.lr == 0.002
    job = EyrieJob.fetch(TRAIN.task_id("given"), connection=ctx.conn, serializer=JSONSerializer)
    assert list(job.args) == [{"run": "given"}] and job.get_status().value == "queued"

    with pytest.raises(EyrieError, match="planned with other settings: lr 0.001 vs 0.002"):  # refused where started
        start_stage(ctx.settings, ctx.conn, ctx.store, "given", Train.name, TrainSettings(lr=0.001))
    assert stored_config(ctx.store, "given").train.lr == 0.002  # the refused start changed nothing
    changed = stored_config(ctx.store, "given").model_copy(update={"train": TrainSettings(lr=0.001)})
    ctx.store.put_json(config_key("given"), changed.model_dump(exclude_unset=True))  # by hand: its planner refuses
    again = execute(PlanTrain, {"run": "given"}, ctx)
    assert again["status"] == "refused" and "planned with other settings: lr 0.001 vs 0.002" in again["error"]
    assert "--as NEW_RUN --lr 0.001" in again["fix"] and "lr 0.001 vs 0.002" in blocked(ctx, "given")


def test_plan_train_plans_a_pipeline_from_its_kept_config(ctx, tmp_path):
    extracted_run(ctx.store, "kept")
    pipeline(ctx, tmp_path, "kept", train={"lr": 0.004, "seq_len": 256})
    assert execute(PlanTrain, {"run": "kept"}, ctx)["status"] == "planned"
    assert load_run_manifest(ctx.store, "kept").train.lr == 0.004


def test_plan_train_with_nothing_to_plan_from_is_refused(ctx):
    extracted_run(ctx.store, "alone")  # no config kept, no settings sent
    result = execute(PlanTrain, {"run": "alone"}, ctx)
    assert result["status"] == "refused" and "nothing to plan" in result["error"] and blocked(ctx, "alone")


def test_eyrie_train_is_planned_by_plan_train(ctx, env):
    """`eyrie train --run R --lr`: checked here, planned by plan-train (here: no trainer's worker is
    up), its line printed from the plan; the training task carries the run alone."""
    extracted_run(ctx.store, "cli")
    out = eyrie_in_process("train", "--run", "cli", "--lr", "0.002", "--seq-len", "256",
                           env={**env, "EYRIE_CACHE_DIR": str(ctx.settings.cache_dir)}).stdout
    assert "run cli: train on 2 samples (1 held out)" in out and "1 task enqueued now" in out, out
    assert load_run_manifest(ctx.store, "cli").train.lr == 0.002
    assert job_state(ctx.conn, PLAN_TRAIN.task_id("cli")) == "finished"
    job = EyrieJob.fetch(TRAIN.task_id("cli"), connection=ctx.conn, serializer=JSONSerializer)
    assert list(job.args) == [{"run": "cli"}]


def test_a_start_alone_refused_by_its_planner_shows_in_status(ctx, tmp_path):
    """POST /runs?stage=train answers before the plan: a base drafter plan-train refuses is the
    stage's failure in the run's status (and the waiting command's one-line error)."""
    extracted_run(ctx.store, "nobase")
    request = TrainSettings(base=str(tmp_path / "no-such-base"))
    started = start_stage(ctx.settings, ctx.conn, ctx.store, "nobase", Train.name, request)
    assert started.planning == PLAN_TRAIN and load_run_manifest(ctx.store, "nobase").train is None
    with pytest.raises(EyrieError, match="no such directory"):
        await_planned(ctx.conn, ctx.store, "nobase", started)
    train = run_status(ctx.conn, ctx.store, "nobase").stages["train"]
    assert train.state == "failed" and "plan-train-nobase-00000: " in train.errors[0]
    assert "no such directory" in train.errors[0] and job_state(ctx.conn, TRAIN.task_id("nobase")) is None


EDGE = """
import sys
for name in ("torch", "transformers", "speculators"):  # what the API's image has not
    sys.modules[name] = None
import redis
from eyrie.core.config import load_settings
from eyrie.core.stage_settings import ExtractSettings, TrainSettings
from eyrie.data.store import open_store
from eyrie.runs.control import start_stage
from eyrie.stages.extract import Extract
from eyrie.stages.train import Train
settings = load_settings()
conn, store = redis.Redis.from_url(settings.redis_url), open_store(settings)
for stage, section in ((Extract, ExtractSettings()), (Train, TrainSettings(lr=0.002))):
    print(start_stage(settings, conn, store, "edge", stage.name, section).planning.name)
"""


def test_the_edge_starts_extract_and_train_without_the_model_libraries(ctx, env):
    """POST /runs?stage=extract|train in the API's process: checked and enqueued with no torch,
    transformers or speculators to import (the API's image has none); the planners plan."""
    extracted_run(ctx.store, "edge")
    ctx.store.put_json(Layout("edge").generate_shard_manifest(0), {})  # generated: extract may start again
    out = subprocess.run([sys.executable, "-c", EDGE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["plan-extract", "plan-train"], out.stderr[-2000:]
    assert [job_state(ctx.conn, kind.task_id("edge")) for kind in (PLAN_EXTRACT, PLAN_TRAIN)] == ["queued"] * 2


@pytest.mark.parametrize("stage", [PlanExtract, PlanTrain, FetchBase])
@pytest.mark.parametrize("payload", [{"run": "r1", "shard": 0}, {"run": "r1", "request": {"no_such_setting": 1}},
                                     {"run": "../r1"}, {}])
def test_a_payload_with_more_than_a_valid_run_is_refused_unrun(ctx, stage, payload):
    with pytest.raises(ValidationError):
        execute(stage, payload, ctx)
    assert blocked(ctx, "r1") is None
