"""Train on the states a run already has (issue 28 item 2), in process: real Redis, a file store, run
a's manifests written as its stages leave them (no server, no worker). A run that differs from a
only in `train:` starts at train on a's objects, with no generate or extract task; `eyrie train
--run a --as c` is the same; the store refuses to delete a's states while they are used. The
training itself on a's states: tests/e2e/test_train_e2e.py."""

import json
import shutil

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.provenance import RUN_CONFIG, as_used
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import TrainSettings
from eyrie.core.target import describe
from eyrie.data import dataset
from eyrie.data.manifest import Layout, TargetRef, load_run_manifest
from eyrie.stages.run_config import stored_config
from eyrie.data.shared_states import StatesInUse, users_of
from eyrie.data.store import open_store
from eyrie.runs.audit import _extract
from eyrie.runs.control import pipeline_started, start_and_plan, start_pipeline, start_stage, train_as
from eyrie.runs.pipeline import advance, run_job_ids, save_config
from eyrie.runs.projection import project
from eyrie.runs.reuse import states_to_reuse
from eyrie.stages import PIPELINE, PLAN_GENERATE, PLAN_TRAIN
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train
from eyrie.work.queue import job_state
from tests.integration.test_refused_start import planned_run
from tests.support.harness import TINY, eyrie_in_process, tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
ROWS = {"dataset": {"limit": 4}}


def states_of(env, tmp_path, *overrides: dict):
    """Pipeline a (`overrides` to its config), generated and extracted (its train not planned yet),
    its manifest's target as generate records it (describe: content hash and chat template),
    advanced once as its last extract task would: its states are recorded by their fingerprint."""
    cfg = load_config(tiny_run_config(tmp_path, "a", ROWS, *overrides))
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    source = cfg.dataset
    planned_run(store, "a", dataset.resolve(source.source, source.split, source.revision, source.limit), None)
    info = describe(cfg.target.model)
    manifest = load_run_manifest(store, "a").model_copy(update={"target": TargetRef(
        model=info.model, revision=info.revision, chat_template_sha256=info.chat_template_sha256, server="vllm"),
        "settings": {Generate.own_section(): as_used(cfg.generate, RUN_CONFIG)}})  # as generate's planner records them
    store.put_json(Layout("a").manifest, manifest.model_dump())
    save_config(conn, store, cfg)
    assert advance(conn, store, "a") == Train.name
    return settings, conn, store


@pytest.fixture
def run_a(env, tmp_path):
    return states_of(env, tmp_path)


def tasks_before_train(conn, store, run: str) -> dict[str, str | None]:
    """Every generate and extract task (planners included) the run may have, with its state."""
    ids = run_job_ids(store, run)
    return {job: job_state(conn, job) for s in PIPELINE[:2] for job in ids.get(s.queue, [])}


def test_a_run_that_differs_only_in_train_starts_at_train_on_the_earlier_runs_states(run_a, tmp_path):
    settings, conn, store = run_a
    b = load_config(tiny_run_config(tmp_path, "b", ROWS, train={"lr": 0.001, "epochs": 1}))
    out = start_and_plan(settings, conn, store, b)

    assert out["states_from"] == "a" and out["started"] == Train.name and out["enqueued"] == 0
    assert "trains on run a's generated answers and hidden states (4 rows" in pipeline_started(out)
    tasks = tasks_before_train(conn, store, "b")
    # generate's planner found a's states (where the generator host's defaults resolve b's settings)
    assert tasks.pop(PLAN_GENERATE.task_id("b")) == "finished"
    assert tasks and set(tasks.values()) == {None}, tasks  # nothing else enqueued, none run
    assert job_state(conn, PLAN_TRAIN.task_id("b")) == "queued"  # train planned by a trainer's worker
    manifest = load_run_manifest(store, "b")
    assert manifest.states_from == "a" and manifest.train is None and manifest.extract.aux_layers == [2, 4, 5]
    extracted = store.get_json(Layout("b").extract_shard_manifest(0))
    assert [s["key"] for s in extracted["samples"]] == [Layout("a").extract_sample(0, f"s{i}") for i in range(4)]
    assert all(key.endswith(".json") for key in store.list("runs/b/"))  # its manifests and config: no object copied

    again = start_and_plan(settings, conn, store, b)  # a rerun continues, still on a's states
    rest = tasks_before_train(conn, store, "b")
    assert again["states_from"] == "a" and rest.pop(PLAN_GENERATE.task_id("b")) == "finished"
    assert set(rest.values()) == {None}

    with pytest.raises(StatesInUse, match="run a's generated answers or hidden states, which run.s. b train on"):
        store.delete(Layout("a").extract_sample(0, "s0"))
    store.delete(Layout("b").train_curve)  # b's own objects are b's to delete

    for i in range(4):  # a's states stored: b's audit counts them done, none lost (it read b's prefix alone)
        store.put_bytes(Layout("a").extract_sample(0, f"s{i}"), b"x")
    records = {0: [{"sample_id": f"s{i}", "status": "done"} for i in range(4)]}
    figure, extracted = _extract(store, manifest, Layout("b"), records)
    assert (figure.done, figure.lost, len(extracted)) == (4, 0, 4), figure


def test_other_extract_settings_or_another_dataset_are_a_new_run(run_a, tmp_path):
    _, _, store = run_a
    assert states_to_reuse(store, load_config(tiny_run_config(tmp_path, "d", ROWS, train={"lr": 0.01}))).run == "a"
    other_layers = load_config(tiny_run_config(tmp_path, "d", ROWS, extract={"layers": [1, 3, 5]}))
    assert states_to_reuse(store, other_layers) is None
    assert states_to_reuse(store, load_config(tiny_run_config(tmp_path, "d", {"dataset": {"limit": 3}}))) is None
    # a setting that only paces generation is the same run
    assert states_to_reuse(store, load_config(tiny_run_config(tmp_path, "d", ROWS, generate={"concurrency": 2})))


def test_train_as_is_the_short_form_and_a_refusal_names_it(run_a, env):
    settings, conn, store = run_a
    out = eyrie_in_process("train", "--run", "a", "--as", "c", "--lr", "0.01", env=env).stdout
    assert "run c: trains on run a's generated answers and hidden states (4 rows" in out and "train started" in out
    assert set(tasks_before_train(conn, store, "c").values()) == {None}
    train = stored_config(store, "c").train
    assert (train.lr, train.epochs, train.draft_vocab) == (0.01, 3, 500)  # a's settings, with those given
    assert job_state(conn, PLAN_TRAIN.task_id("c")) == "queued" and load_run_manifest(store, "c").states_from == "a"

    with pytest.raises(EyrieError, match="exists already, with states of its own"):
        train_as(settings, conn, store, "c", "a", TrainSettings(lr=0.01))

    planned_run(store, "t", "prompts.jsonl", trained_with_lr=3e-3)
    with pytest.raises(EyrieError) as refused:
        start_stage(settings, conn, store, "t", Train.name, TrainSettings(lr=0.001))
    assert "planned with other settings: lr 0.001 vs 0.003" in refused.value.problem
    assert "`eyrie train --run t --as NEW_RUN --lr 0.001`" in refused.value.fix


def test_the_plan_of_a_run_on_earlier_states_counts_no_generation_or_extraction(run_a, tmp_path):
    """`eyrie run --config B --plan`: generate and extract take no hours, named as a's reused; the
    training hours are B's own."""
    from eyrie.runs.plan_lines import render
    from eyrie.runs.projection import project

    settings, _, _ = run_a
    plan = project(load_config(tiny_run_config(tmp_path, "b", ROWS, train={"lr": 0.001})), settings)
    assert plan.states_from == "a"
    assert plan.hours["generate"]["hours"] == plan.hours["extract"]["hours"] == 0
    shown = "\n".join(render(plan))
    assert "generate     0.00 h: none: run a's, reused (same settings and rows)" in shown, shown
    assert "extract      0.00 h: none: run a's, reused" in shown and "tokens trained" in shown
    other = project(load_config(tiny_run_config(tmp_path, "d", ROWS, extract={"layers": [1, 3, 5]})), settings)
    assert other.states_from is None and other.hours["generate"]["tokens"] > 0


def test_a_changed_target_or_serving_shares_no_states_and_the_new_run_generates(env, tmp_path):
    """Issue 41 item 1: the same config under a new name is offered a's states only while the target
    is what answered a (its directory's content and chat template, as the manifest records them)
    and is served alike (serve.extra_args, serve.max_model_len); else --plan and the run reuse
    nothing (no error): the new run generates."""
    target = tmp_path / "target"
    shutil.copytree(TINY, target)
    on_it = {"target": {"model": str(target)}}
    settings, conn, store = states_of(env, tmp_path, on_it)

    def config(*overrides: dict):
        return load_config(tiny_run_config(tmp_path, "d", ROWS, on_it, *overrides))

    assert states_to_reuse(store, config()).run == "a" and project(config(), settings).states_from == "a"
    assert states_to_reuse(store, config({"serve": {"extra_args": ["--dtype", "float32"]}})) is None
    assert states_to_reuse(store, config({"serve": {"max_model_len": 512}})) is None
    assert states_to_reuse(store, config({"serve": {"tensor_parallel_size": 2}})).run == "a"  # how many GPUs: same answers

    updated = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**updated, "eyrie_test_key": 1}))  # updated in place
    assert states_to_reuse(store, config()) is None
    plan = project(config(), settings)
    assert plan.states_from is None and plan.hours["generate"]["tokens"] > 0
    out = start_pipeline(settings, conn, store, config())
    assert out["states_from"] is None and out["planning"], out  # generates: its planner is enqueued
    assert job_state(conn, out["planning"]) == "queued" and users_of(store, "a") == []
