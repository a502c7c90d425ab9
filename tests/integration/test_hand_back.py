"""An extract task asked to stop (its worker's SIGTERM: the InProcessWorker that runs a GPU stage's
tasks sets the request in its own process) hands its shard back after the batch in hand: what it
extracted stays stored, nothing is marked done, and the next attempt finishes the shard with every
sample once (issue 29, defect 7). Real Redis and store, the vLLM stand-in answering generate; the
tasks run in this process (the worker's part, SIGTERM to a real worker, is
tests/e2e/test_faults.py's and tests/integration/test_extract_waits.py's)."""

import json

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, ShardManifest
from eyrie.data.store import open_store
from eyrie.tasks.executor import Context, execute
from eyrie.work import cancel
from tests.support.harness import TINY, eyrie_in_process

ROWS = 24


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_an_extract_task_asked_to_stop_hands_its_shard_back_and_the_next_attempt_finishes_it(
        env, stub_server, tmp_path, monkeypatch):
    from eyrie_extractor.shard import ExtractRunner
    from eyrie_generator.shard import ShardRunner

    settings_env = {"EYRIE_INFERENCE_URL": stub_server(tokens=16), "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY),
                    "EYRIE_EXTRACT_BATCH_TOKENS": "64", "EYRIE_DEVICE": "cpu"}  # a sample a batch: many batches
    for key, value in settings_env.items():
        monkeypatch.setenv(key, value)
    env = {**env, **settings_env}
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(ROWS)))
    eyrie_in_process("generate", "--dataset", str(data), "--run", "hb", "--shard-size", str(ROWS), env=env)
    settings = load_settings()
    ctx = Context(settings, redis.Redis.from_url(settings.redis_url), open_store(settings))
    assert execute(ShardRunner, {"run": "hb", "shard": 0}, ctx)["status"] == "done"
    eyrie_in_process("extract", "--run", "hb", "--layers", "2,4,5", env=env)

    store, layout = ctx.store, Layout("hb")
    cancel.STOP_REQUESTED.set()
    try:
        first = execute(ExtractRunner, {"run": "hb", "shard": 0}, ctx)
    finally:
        cancel.STOP_REQUESTED.clear()
    assert first["status"] == "handed_back", first
    assert not store.exists(layout.extract_shard_manifest(0))
    kept = store.list(layout.extract_parts(0))
    assert kept, "what was extracted before the stop was not stored"

    assert execute(ExtractRunner, {"run": "hb", "shard": 0}, ctx)["status"] == "done"
    shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(0)))
    ids = [s["sample_id"] for s in shard.samples]
    assert len(ids) == len(set(ids)) == ROWS
