"""bench/real_model.py: a run that outlasts a sitting. Its Redis (AOF) and store live under one home outside the
work tree; a second sitting on the same home finds the first one's state, says what it reuses, starts only the
services still needed, and `eyrie run` asks for nothing done again (the vLLM stand-in counts the requests)."""


import pytest
import redis
import requests

from eyrie.data.manifest import Layout
from eyrie.data.store import FileStore
from tests.support.harness import OFFLINE, eyrie, numbered_prompts, tiny_run_config

import real_model as rm

QUEUES = {"generate": "generator", "extract": "extractor", "train": "trainer"}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_second_sitting_continues_the_first_ones_run_and_asks_for_no_done_shard_again(stub_server, tmp_path):
    stub, home = stub_server(tokens=4), tmp_path / "home"
    config = tiny_run_config(tmp_path, "sittings", dataset={"source": numbered_prompts(tmp_path / "p.jsonl", 30)},
                             generate={"shard_size": 10, "max_tokens": 8})
    outside = {**OFFLINE, "EYRIE_INFERENCE_URL": stub, "EYRIE_SERVER": "vllm"}
    with rm.own_redis(home) as (url, started):  # sitting 1: generation, then it stops
        env = {**rm.os.environ, **outside, **rm.home_env(home, url)}
        assert started and redis.Redis.from_url(url).config_get("appendonly") == {"appendonly": "yes"}
        with rm.own_redis(home) as (again, second):  # one answering there is used, and left running
            assert (again, second) == (url, False)
        assert "3 generate tasks enqueued now" in eyrie("run", "--config", config, env=env).stdout
        eyrie("worker", "generate", "--burst", env=env)
    assert not rm._answers(url) and requests.get(f"{stub}/stats").json()["total"] == 30
    store = FileStore(home / "store")
    assert (home / "redis" / "appendonlydir").is_dir() and store.exists(Layout("sittings").manifest)

    with rm.own_redis(home) as (url, started):  # sitting 2: a new redis-server on the same AOF
        env = {**rm.os.environ, **outside, **rm.home_env(home, url)}
        assert started and redis.Redis.from_url(url).sismember("eyrie:pipelines:active", "sittings")
        done = rm.progress(store, "sittings")
        assert rm.reused_line(done) == "reused: 3 of 3 generate shards done, 0 of 3 extract shards done, " \
                                       "no train checkpoint"
        assert [name for name, _ in rm.services_needed(done, "vllm", QUEUES)] == [
            "serve-extract", "generator", "extractor", "trainer"]  # no server for the target: generation is done
        assert "0 generate tasks enqueued now" in eyrie("run", "--config", config, env=env).stdout
    assert requests.get(f"{stub}/stats").json()["total"] == 30


def _shard_manifests(store, run: str, stage: str, n: int) -> None:
    for index in range(n):
        store.put_json(Layout(run).shard_manifest(stage, index), {"index": index})


def test_what_a_sitting_reuses_and_starts_follows_the_stores_keys(tmp_path):
    store, layout = FileStore(tmp_path), Layout("r")
    assert rm.reused_line(rm.progress(store, "r")) == "reused: nothing (a new run)"
    assert [n for n, _ in rm.services_needed(None, "vllm", QUEUES)][:2] == ["inference", "serve-extract"]
    store.put_json(layout.manifest, {"run": "r", "generate_shards": [{"index": i} for i in range(12)], "extract": None})
    _shard_manifests(store, "r", "generate", 7)
    assert rm.reused_line(rm.progress(store, "r")).startswith("reused: 7 of 12 generate shards done, 0 of 12 extract")
    store.put_json(layout.manifest, {**store.get_json(layout.manifest), "extract": {"backend": "vllm"}})
    _shard_manifests(store, "r", "generate", 12)
    _shard_manifests(store, "r", "extract", 12)
    for label, epoch, step in (("0", 0, 0), ("3", 3, 0), ("4-step-20", 4, 20), ("2", 2, 0)):
        store.put_json(layout.checkpoint_manifest(label), {"label": label, "epoch": epoch, "local_step": step})
    store.put_bytes(layout.checkpoint_file("3", "config.json"), b"{}")  # a checkpoint's file is not its manifest
    p = rm.progress(store, "r")
    assert rm.reused_line(p) == "reused: 12 of 12 generate shards done, extract done, train checkpoint epoch 4 step 20"
    assert [n for n, _ in rm.services_needed(p, "vllm", QUEUES)] == ["generator", "extractor", "trainer"]
    store.put_json(layout.drafter_manifest, {})
    store.put_json(layout.manifest, {**store.get_json(layout.manifest), "verify": {"acceptance": 2.1}})
    assert rm.reused_line(rm.progress(store, "r")).endswith("epoch 4 step 20, exported, verified")


def test_home_is_the_flag_else_eyrie_home_else_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("EYRIE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rm.home_dir(None) == tmp_path / ".cache" / "eyrie"
    monkeypatch.setenv("EYRIE_HOME", str(tmp_path / "h"))
    assert rm.home_dir(None) == tmp_path / "h" and rm.home_dir(tmp_path / "flag") == tmp_path / "flag"
    env = rm.home_env(tmp_path / "h", "redis://127.0.0.1:1/0")
    assert all(str(tmp_path / "h") in v for k, v in env.items() if k != "EYRIE_REDIS_URL")
