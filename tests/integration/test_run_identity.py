"""A run is made of its inputs by content and of its settings as used (issue 49), in process: real
Redis, a file store, the tiny target copied where each test wants it. Generation itself is not run
(no server here): a generate shard's manifest is written as its task leaves it, the one test double.

- a run carried to another path (a clone elsewhere, another machine) continues at extraction;
- the target's weights changed in place at the same size share nothing and continue nothing;
- relative paths, then absolute ones, continue one run;
- `eyrie generate` with no target named takes the served one, never a default path;
- the generate settings are recorded as used, a host default with its source."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import redis
import yaml

from bench.answers_carry import restore_answers, save_answers
from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.data.manifest import Counts, Layout, ShardManifest, load_run_manifest, now_iso
from eyrie.data.store import open_store
from eyrie.runs.control import start_and_plan, start_pipeline, start_stage, await_planned
from eyrie.runs.reuse import states_to_reuse
from eyrie.runs.serve_turns import same_server
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.run_config import load_config, stored_config
from eyrie.work import inference
from tests.support.harness import ROOT, TINY, TRAIN_PROMPTS, eyrie_in_process, own_db, rel, tiny_run_config

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
ROWS = {"dataset": {"limit": 8}}


def inputs_at(where: Path) -> tuple[Path, Path]:
    """The tiny target and its prompts copied under `where` (a machine's own paths)."""
    target, prompts = where / "target", where / "prompts.jsonl"
    shutil.copytree(TINY, target)
    shutil.copyfile(TRAIN_PROMPTS, prompts)
    return target, prompts


def config_at(tmp_path: Path, run: str, target: Path, prompts: Path, *overrides: dict):
    return load_config(tiny_run_config(tmp_path, run, ROWS, *overrides, target={"model": str(target)},
                                       dataset={"source": str(prompts)}))


def generated(store, run: str) -> None:
    """Every generate shard of `run` finished, as its task leaves it (no server here)."""
    layout, manifest = Layout(run), load_run_manifest(store, run)
    for plan in manifest.generate_shards:
        rows = plan.row_end - plan.row_start
        store.put_json(layout.generate_shard_manifest(plan.index), ShardManifest(
            run=run, stage=Generate.name, shard=plan.index, bytes=1, counts=Counts(total=rows, done=rows),
            skip_reasons={}, failure_errors={}, started_at=now_iso(), finished_at=now_iso(), worker="test").model_dump())


def flip_4kb(weights: Path) -> None:
    """4 KB of the weights changed in place, the file's size the same."""
    data = bytearray(weights.read_bytes())
    data[1024:5120] = bytes(b ^ 0xFF for b in data[1024:5120])
    weights.write_bytes(bytes(data))


@pytest.fixture
def conn(env):
    return redis.Redis.from_url(env["EYRIE_REDIS_URL"])


def test_a_run_carried_to_another_path_continues_at_extraction(env, conn, tmp_path):
    """Planned and generated on machine A (its inputs under a/), its answers saved as
    bench/answers_carry.py saves them; restored into machine B's empty store with the same
    inputs under b/: `eyrie run` continues it at extraction, and its manifest reads them at b/."""
    settings = load_settings()
    first, second = open_store(settings), open_store(settings.model_copy(update={"store_url": f"file://{tmp_path}/b-store"}))
    target_a, prompts_a = inputs_at(tmp_path / "a")
    start_and_plan(settings, conn, first, config_at(tmp_path, "moved", target_a, prompts_a))
    generated(first, "moved")
    archive = tmp_path / "moved.tar.xz"
    assert save_answers(first, "moved", archive) > 0

    target_b, prompts_b = inputs_at(tmp_path / "b")
    shutil.rmtree(tmp_path / "a")  # machine A's paths do not exist on machine B
    assert restore_answers(second, "moved", archive) > 0
    conn, _ = own_db(env["EYRIE_REDIS_URL"], 9)  # machine B's own Redis
    out = start_pipeline(settings, conn, second, config_at(tmp_path, "moved", target_b, prompts_b))
    assert out["started"] == Extract.name
    manifest = load_run_manifest(second, "moved")
    assert Path(manifest.target.model) == target_b.resolve() and manifest.dataset.source == str(prompts_b)

    flip_4kb(target_b / "model.safetensors")  # the same path and size, other weights: not this run's target
    with pytest.raises(EyrieError) as refused:
        start_pipeline(settings, conn, second, config_at(tmp_path, "moved", target_b, prompts_b))
    assert "was made with revision sha256:" in refused.value.problem and str(target_b) in refused.value.problem


def test_weights_changed_in_place_at_the_same_size_share_no_states(env, conn, tmp_path):
    """Run a's states are recorded; after 4 KB of its target's weights change in place (same
    size), a run like it finds none (at 40c2bde the weights were known by name and size)."""
    from tests.integration.test_reuse_states import ROWS as A_ROWS, states_of

    target, _ = inputs_at(tmp_path / "t")
    _, conn, store = states_of(env, tmp_path, {"target": {"model": str(target)}})
    b = load_config(tiny_run_config(tmp_path, "b", A_ROWS, {"target": {"model": str(target)}}, train={"lr": 0.01}))
    assert states_to_reuse(store, b).run == "a"
    flip_4kb(target / "model.safetensors")
    assert states_to_reuse(store, b) is None


def test_relative_then_absolute_paths_continue_one_run(env, conn, tmp_path, monkeypatch):
    """`eyrie generate` given relative paths (README's, from the repository's root), then `eyrie run
    --config` naming them absolute: one run (at 40c2bde: refused as another config)."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(tiny_run_config(tmp_path, "rel", ROWS))  # absolute paths
    settings = load_settings(model=rel(TINY))
    store = open_store(settings)
    source = DatasetSection(source=rel(TRAIN_PROMPTS), limit=8)
    await_planned(conn, store, "rel", start_stage(settings, conn, store, "rel", Generate.name,
                                                  GenerateSettings(**cfg.generate.given()), source))
    kept = stored_config(store, "rel")
    assert kept.target.model == str(TINY) and kept.dataset.source == str(TRAIN_PROMPTS)  # made absolute here
    out = start_pipeline(settings, conn, store, cfg)
    assert out["run"] == "rel" and stored_config(store, "rel").stages is None


def test_generate_alone_with_no_target_named_takes_the_served_one(env, tmp_path, monkeypatch):
    """No --model, no EYRIE_MODEL: the served model is the target (the stack's inference service then
    goes on serving it: no switch to a model its image lacks); with none served, a clear refusal
    (at 40c2bde the config named assets/tiny-target, the code's default)."""
    monkeypatch.delenv("EYRIE_MODEL", raising=False)
    conn, _ = own_db(env["EYRIE_REDIS_URL"], 10)  # no endpoint of another test's server in it
    target, prompts = inputs_at(tmp_path / "served")
    settings = load_settings()
    assert "model" not in settings.model_fields_set
    store = open_store(settings)
    source = DatasetSection(source=str(prompts), limit=8)
    with pytest.raises(EyrieError, match="no target named"):
        start_stage(settings, conn, store, "unserved", Generate.name, GenerateSettings(), source)
    assert stored_config(store, "unserved") is None

    endpoint = inference.Endpoint(url="http://127.0.0.1:9", model=str(target), server="transformers", state="ready")
    inference.publish(conn, endpoint)  # as the stack's inference service publishes what it serves
    start_stage(settings, conn, store, "served", Generate.name, GenerateSettings(), source)
    assert stored_config(store, "served").target.model == str(target)
    assert same_server(store, "served", endpoint, str(target))


def test_the_generate_settings_are_recorded_as_used_with_their_source(env, conn, tmp_path, monkeypatch):
    """Planned on a generator host with EYRIE_MAX_TOKENS=512: the manifest records 512 from the host's
    environment, the given concurrency from the run config, top_p as the code's default."""
    monkeypatch.setenv("EYRIE_MAX_TOKENS", "512")
    raw = yaml.safe_load(Path(tiny_run_config(tmp_path, "used", ROWS)).read_text())
    raw["generate"].pop("max_tokens")
    (tmp_path / "used.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "used.yaml")
    settings = load_settings(model=cfg.target.model)
    start_and_plan(settings, conn, open_store(settings), cfg)
    used = load_run_manifest(open_store(settings), "used").settings["generate"]
    assert used["max_tokens"] == {"value": 512, "source": "host environment (EYRIE_MAX_TOKENS)"}
    assert used["concurrency"] == {"value": 8, "source": "run config"}
    assert used["top_p"] == {"value": None, "source": "default"}
    shown = eyrie_in_process("show", "used", env=dict(os.environ)).stdout  # every setting, value and source
    assert re.search(r"generate\.max_tokens +512 +host environment \(EYRIE_MAX_TOKENS\)", shown), shown
    assert all(re.search(rf"generate\.{name} ", shown) for name in GenerateSettings.model_fields)
