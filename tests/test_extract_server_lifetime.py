"""How long the stack's vLLM extraction server (`eyrie serve-extract`) lives (issue 23): an offline
run needs it until every shard is extracted; a hybrid or online run until its drafter is trained,
since the trainer asks it for the hidden states not stored (an online run's extract stage needs
none, its training does). Cancelled or no longer active: it stops. Real Redis and a real file
store; the lifetime end to end through tests/fake_vllm (as in tests/test_extract_server.py)."""

import os
import subprocess
import time

import pytest
import redis

from conftest import BIN, ROOT, free_port, stop
from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout
from eyrie.data.store import open_store
from eyrie.runs.pipeline import config_key
from eyrie.work import inference, keys
from eyrie.work.gpu import holder
from eyrie_inference.extract_server import ExtractServer, extraction_run
from test_extract_server import RUN, _config, _manifest, extract_server_ready

OFFLINE_RUN = "a-offline"  # sorted before RUN: extraction_run passes over it


def _settings(redis_url: str, tmp_path):
    return load_settings(store_url=f"file://{tmp_path / 'store'}", redis_url=redis_url,
                         extract_shared_dir=str(tmp_path / "hs"))


def _plant(conn, store, run: str, storage: str, shards=(0, 1)) -> None:
    """An active run on the vLLM backend whose extract stage stores `storage`, `shards` extracted."""
    manifest = _manifest()
    params = manifest.extract.model_copy(update={"storage": storage})
    manifest = manifest.model_copy(update={"run": run, "extract": params})
    store.put_json(config_key(run), _config().model_copy(update={"run": run}).model_dump())
    store.put_json(Layout(run).manifest, manifest.model_dump())
    for shard in shards:
        store.put_json(Layout(run).extract_shard_manifest(shard), {})
    conn.sadd(keys.ACTIVE_PIPELINES, run)


@pytest.mark.parametrize("storage", ["hybrid", "online"])
def test_a_run_training_on_demand_is_served_after_extraction_until_its_drafter_is_trained(storage, redis_url,
                                                                                          tmp_path):
    conn, store = redis.Redis.from_url(redis_url), open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, OFFLINE_RUN, "offline")
    _plant(conn, store, RUN, storage)
    assert extraction_run(conn, store) == RUN  # extracted, still training: the offline one is done
    store.put_json(Layout(RUN).drafter_manifest, {})
    assert extraction_run(conn, store) is None


def test_the_server_of_a_run_training_on_demand_stops_once_trained_cancelled_or_inactive(redis_url, tmp_path):
    conn, store = redis.Redis.from_url(redis_url), open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, RUN, "hybrid")
    server = ExtractServer(_settings(redis_url, tmp_path), conn, store, RUN)
    assert not server._drained()  # every shard extracted, the trainer still asks it for states
    conn.srem(keys.ACTIVE_PIPELINES, RUN)
    assert server._drained()
    conn.sadd(keys.ACTIVE_PIPELINES, RUN)
    conn.set(keys.cancelled(RUN), "now")
    assert server._drained()
    conn.delete(keys.cancelled(RUN))
    assert not server._drained()
    store.put_json(Layout(RUN).drafter_manifest, {})
    assert server._drained()


def test_serve_extract_starts_for_an_extracted_online_run_and_stops_once_it_is_trained(redis_url, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EYRIE_REDIS_URL": redis_url,
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_EXTRACT_SHARED_DIR": str(tmp_path / "hs"),
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    store = open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, RUN, "online")
    log = tmp_path / "serve-extract.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve-extract", "--once", "--port", str(free_port())], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        extract_server_ready(conn, 60)
        assert "run xs trains on hidden states made on vLLM (extract.storage online)" in log.read_text()
        _wait_for_line(log, "serving until its drafter is trained", proc)
        assert proc.poll() is None and holder(conn)["holder"]["owner"].startswith("extract-server@")
        store.put_json(Layout(RUN).drafter_manifest, {})
        assert proc.wait(60) == 0, log.read_text()
        assert holder(conn) is None and inference.read_extract(conn).state == "stopped"
        assert "run xs is trained: stopping vLLM and handing over the GPUs" in log.read_text()
    finally:
        stop(proc)


def _wait_for_line(log, text: str, proc, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.2)
