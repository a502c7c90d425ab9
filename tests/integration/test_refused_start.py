"""A refused command changes nothing (issue 29, defect 6): `eyrie cancel R`, then a start that is
refused (`eyrie train --run R` with other settings, `eyrie run` whose dataset changed) leaves R
cancelled, with nothing enqueued. In process: real Redis, a file store, a run's manifests written
as its stages would have (no server, no worker)."""

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import TrainSettings
from eyrie.data.manifest import (Counts, DatasetRef, ExtractParams, GenerateParams, Layout, RunManifest,
                                 SamplingParams, ShardManifest, ShardPlan, TargetRef, TrainParams, now_iso)
from eyrie.data.store import open_store
from eyrie.runs.control import cancel_run, start_pipeline, start_stage
from eyrie.runs.pipeline import save_config
from eyrie.runs.status import overall_state, run_status
from eyrie.stages import PIPELINE
from eyrie.stages.train import Train
from eyrie.work import keys
from eyrie.work.queue import job_state, queue
from tests.support.harness import TINY, tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)


def planned_run(store, run: str, source: str | DatasetRef, trained_with_lr: float | None) -> None:
    """A run generated, extracted and (unless `trained_with_lr` is None) planned to train, as its
    stages leave it: its dataset `source` (a file name, planned with another revision) or the
    dataset as planned; one shard of 4 rows whose samples are objects of the run."""
    layout = Layout(run)
    ref = source if isinstance(source, DatasetRef) else DatasetRef(source=source, kind="jsonl", revision="0" * 64,
                                                                   row_end=4)
    train = None if trained_with_lr is None else TrainParams(
        epochs=3, draft_vocab=500, vocab_mapping="frequency", lr=trained_with_lr, total_seq_len=256, train_samples=3,
        heldout_samples=1, speculators_version="test")
    manifest = RunManifest(
        run=run, created_at=now_iso(), code_version="test",
        target=TargetRef(model=str(TINY), revision="local", chat_template_sha256=None, server="transformers"),
        dataset=ref,
        generate=GenerateParams(sampling=SamplingParams(max_tokens=64), concurrency=8, request_timeout_s=60,
                                max_retries=1, shard_size=4),
        generate_shards=[ShardPlan(index=0, row_start=0, row_end=4, input_key=layout.generate_input(0),
                                   input_sha256="0" * 64)],
        extract=ExtractParams(backend="hf", aux_layers=[2, 4, 5], dtype="bf16", max_length=None, num_layers=6,
                              hidden_size=64, samples=4, tokens=100, truncated=0, projected_bytes=1, budget_bytes=None),
        train=train)
    store.put_json(layout.manifest, manifest.model_dump())
    samples = [{"sample_id": f"s{i}", "key": layout.extract_sample(0, f"s{i}"), "sha256": "0" * 64, "bytes": 1}
               for i in range(4)]
    for stage in PIPELINE[:2]:  # the stages before train: every shard's manifest stored
        store.put_json(layout.shard_manifest(stage.name, 0), ShardManifest(
            run=run, stage=stage.name, shard=0, bytes=1, counts=Counts(total=4, done=4), skip_reasons={},
            failure_errors={}, started_at=now_iso(), finished_at=now_iso(), worker="test",
            samples=samples if stage.makes_states else []).model_dump())


def queued(conn) -> dict[str, list[str]]:
    return {s.queue: queue(conn, s.queue).get_job_ids() for s in PIPELINE}


def test_a_refused_train_leaves_a_cancelled_run_cancelled(env):
    settings = load_settings()
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    planned_run(store, "r", "prompts.jsonl", trained_with_lr=3e-3)
    cancel_run(conn, store, "r")
    before = queued(conn)

    with pytest.raises(EyrieError, match="planned with other settings: lr 0.001 vs 0.003"):
        start_stage(settings, conn, store, "r", Train.name, TrainSettings(lr=0.001))

    assert conn.exists(keys.cancelled("r")) and overall_state(run_status(conn, store, "r")) == "cancelled"
    assert queued(conn) == before


def test_a_refused_pipeline_rerun_leaves_a_cancelled_run_cancelled(env, tmp_path):
    """The dataset file changed since the run planned it: refused at once, before anything is written."""
    cfg = load_config(tiny_run_config(tmp_path, "q", dataset={"limit": 4}))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    planned_run(store, "q", cfg.dataset.source, trained_with_lr=cfg.train.lr)
    save_config(conn, store, cfg)
    cancel_run(conn, store, "q")
    before = queued(conn)

    with pytest.raises(EyrieError, match="already exists with other settings: dataset"):
        start_pipeline(settings, conn, store, cfg)

    assert conn.exists(keys.cancelled("q")) and overall_state(run_status(conn, store, "q")) == "cancelled"
    assert not conn.sismember(keys.ACTIVE_PIPELINES, "q") and queued(conn) == before


def test_a_base_that_does_not_fit_leaves_a_cancelled_run_cancelled(env, tmp_path, monkeypatch):
    """A refusal only planning can make (issue 41, item 12): `eyrie train --run R --base B` on a
    cancelled run, B's hidden size not the target's. The trainer's planning refuses it while the
    cancel stays (a cancel being lifted stops none of the tasks that planning enqueues); a start that
    plans lifts it, and only then."""
    from eyrie.runs.control import await_planned
    from eyrie.stages import TRAIN
    from eyrie.work.cancel import CancelWatch
    from tests.support.legacy_drafter import build_legacy_drafter
    from tests.unit.test_stage_constructors import extracted_run

    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache"))
    settings = load_settings()
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    extracted_run(store, "b")
    cancel_run(conn, store, "b")
    narrow = build_legacy_drafter(tmp_path / "narrow", TINY, hidden_size=32)

    started = start_stage(settings, conn, store, "b", Train.name, TrainSettings(base=str(narrow)))
    assert overall_state(run_status(conn, store, "b")) == "cancelled" and not CancelWatch(conn, "b")()
    with pytest.raises(EyrieError, match=r"does not fit target .*hidden size 32 \(base\) vs 64"):
        await_planned(conn, store, "b", started)  # its planning, run here (no worker up)
    assert conn.exists(keys.cancelled("b")) and overall_state(run_status(conn, store, "b")) == "cancelled"
    assert CancelWatch(conn, "b")() and not queue(conn, TRAIN.queue).get_job_ids()

    await_planned(conn, store, "b", start_stage(settings, conn, store, "b", Train.name, TrainSettings()))
    assert not conn.exists(keys.cancelled("b")) and queue(conn, TRAIN.queue).get_job_ids() == [TRAIN.task_id("b")]


def test_a_pipeline_rerun_whose_base_does_not_fit_leaves_a_cancelled_run_cancelled(env, tmp_path, monkeypatch):
    """`eyrie run` again on a cancelled pipeline with a base drafter that does not fit: the base is
    fetched and checked first, while the run stays cancelled; refused, nothing else started (its
    generate planning not even enqueued) and the run neither active nor uncancelled. Rerun without
    it: planned, and only then the cancel lifted and the pipeline active and going on."""
    from eyrie.data.dataset import resolve
    from eyrie.runs.control import start_and_plan
    from eyrie.stages import FETCH, PLAN_GENERATE
    from tests.support.legacy_drafter import build_legacy_drafter

    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(tiny_run_config(tmp_path, "p", dataset={"limit": 4}))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    planned_run(store, "p", resolve(cfg.dataset.source, limit=4), trained_with_lr=None)  # train not planned
    save_config(conn, store, cfg)
    cancel_run(conn, store, "p")
    narrow = build_legacy_drafter(tmp_path / "narrow", TINY, hidden_size=32)
    based = cfg.model_copy(update={"train": cfg.train.model_copy(update={"base": str(narrow)})})

    with pytest.raises(EyrieError, match=r"hidden size 32 \(base\) vs 64"):
        start_and_plan(settings, conn, store, based)
    assert conn.exists(keys.cancelled("p")) and overall_state(run_status(conn, store, "p")) == "cancelled"
    assert not conn.sismember(keys.ACTIVE_PIPELINES, "p") and not any(queued(conn).values())
    assert job_state(conn, FETCH.task_id("p")) == "finished" and job_state(conn, PLAN_GENERATE.task_id("p")) is None

    start_and_plan(settings, conn, store, cfg)
    assert not conn.exists(keys.cancelled("p")) and conn.sismember(keys.ACTIVE_PIPELINES, "p")
    assert job_state(conn, PLAN_GENERATE.task_id("p")) == "finished"
    assert overall_state(run_status(conn, store, "p")) == "in_progress"
