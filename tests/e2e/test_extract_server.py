"""The stack's vLLM extraction server (`eyrie serve-extract`, issue 14): started for a run whose
extract stage runs on the vLLM backend, under the GPU lease like inference, configured from the run
config, published for the extractor, stopped (lease handed back) once every shard is extracted.
tests/fake_vllm stands in for the `vllm` command (an OpenAI-shaped server on the port it is given:
eyrie's supervision is under test; real vLLM extraction: tests/e2e/test_vllm_backend.py); the lease, Redis, the store, the command line and the supervision are real.
The command from the run, without a process: tests/unit/test_extract_server_command.py."""

import os
import subprocess
import time

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import RunConfig
from eyrie.data.manifest import Layout, RunManifest, config_key
from eyrie.data.store import open_store
from eyrie.work import inference, keys
from eyrie.work.extract_server import ServerWait
from eyrie.work.gpu import GpuLease, holder
from eyrie_inference.extract_server import extraction_run
from tests.support.builders import make_manifest
from tests.support.harness import BIN, ROOT, TINY, TRAIN_PROMPTS
from tests.support.processes import free_port, stop

RUN = "xs"


def _config(**serve) -> RunConfig:
    return RunConfig.model_validate({
        "run": RUN, "target": {"model": str(TINY)}, "dataset": {"source": str(TRAIN_PROMPTS)},
        "serve": {"tensor_parallel_size": 2, "trust_remote_code": True, "max_model_len": 600, **serve},
        "extract": {"backend": "vllm", "layers": [2, 4, 5], "max_length": 512}})


def _manifest() -> RunManifest:
    return make_manifest(RUN, 20, shard_size=10, source=str(TRAIN_PROMPTS), max_tokens=64, concurrency=8,
                         extract={"max_length": 512, "tokens": 2000})


def test_the_extractor_waits_for_a_published_server_and_says_how_to_start_one(redis_url):
    with pytest.raises(EyrieError, match="no vLLM extraction server became ready.*eyrie serve-extract"):
        extract_server_ready(redis.Redis.from_url(redis_url), 0.5)


def test_served_under_the_lease_from_the_run_config_and_stopped_once_extracted(redis_url, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EYRIE_REDIS_URL": redis_url,
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_EXTRACT_SHARED_DIR": str(tmp_path / "hs"),
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    store = open_store(load_settings(store_url=env["EYRIE_STORE_URL"], redis_url=redis_url))
    store.put_json(config_key(RUN), _config().model_dump())
    store.put_json(Layout(RUN).manifest, _manifest().model_dump())
    store.put_json(Layout(RUN).extract_shard_manifest(0), {})
    conn.sadd(keys.ACTIVE_PIPELINES, RUN)
    assert extraction_run(conn, store) == RUN
    inference_lease = GpuLease(conn, "inference@test")
    assert inference_lease.acquire(wait_s=5)
    log = tmp_path / "serve-extract.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve-extract", "--once", "--port", str(free_port())], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(w.startswith("extract-server@") for w in (holder(conn) or {}).get("waiting", [])):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert holder(conn)["holder"]["owner"] == "inference@test"  # never two owners: it waits
        inference_lease.release()  # inference drained and handed over
        endpoint = extract_server_ready(conn, 60)
        assert holder(conn)["holder"]["owner"].startswith("extract-server@")
        assert inference.read(conn) is None or inference.read(conn).name != "extract"  # not an inference endpoint
        assert endpoint.model == str(TINY)
        text = log.read_text()
        assert "extract_hidden_states" in text and "--tensor-parallel-size 2" in text and "--trust-remote-code" in text
        store.put_json(Layout(RUN).extract_shard_manifest(1), {})  # the last shard extracted
        assert proc.wait(60) == 0, log.read_text()
        assert holder(conn) is None  # the GPUs handed back (to the trainer)
        assert inference.read_extract(conn).state == "stopped"
        assert "is extracted: stopping vLLM and handing over the GPUs" in log.read_text()
    finally:
        stop(proc)


def extract_server_ready(conn, deadline_s: float):
    """The wait an extract task does (nothing reported, never cancelled)."""
    return ServerWait(conn, deadline_s, report=lambda text: None, cancelled=lambda: False, gpu_wait_s=3600).ready()
