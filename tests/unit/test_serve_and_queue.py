"""`eyrie serve` (readiness published in Redis, deadlines, the real vLLM command line) and the
queue's JSON-only, schema-checked payloads."""

import os
import json
import subprocess
import zlib

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.work import inference
from eyrie.work.queue import connect, queue
from eyrie_inference.server import command, health_path
from tests.support.harness import BIN, OFFLINE, ROOT, TINY, eyrie
from tests.support.processes import free_port


def test_serve_publishes_a_ready_endpoint(tiny_server, redis_server):
    endpoint = inference.read(redis.Redis.from_url(redis_server))
    assert endpoint.state == "ready" and endpoint.server == "transformers"
    assert endpoint.model == str(TINY) and endpoint.max_model_len == 512
    assert endpoint.revision.startswith("sha256:") and len(endpoint.chat_template_sha256) == 64
    import requests

    assert requests.get(f"{endpoint.url}/health", timeout=5).status_code == 200


def test_serve_fails_clearly_when_the_server_dies(redis_url, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory the server cannot load
    redis_url = redis_url.rsplit("/", 1)[0] + "/1"  # away from the session's tiny server endpoint
    redis.Redis.from_url(redis_url).flushdb()
    env = {**__import__("os").environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url,
           "EYRIE_SERVE_DEADLINE_S": "120"}
    result = subprocess.run([str(BIN / "eyrie"), "serve", "--model", str(tmp_path), "--port", str(free_port())],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1
    assert "exited with code" in result.stderr and "Fix:" in result.stderr
    assert inference.read(redis.Redis.from_url(redis_url)).state == "failed"


def test_serve_deadline(redis_url):
    env = {**__import__("os").environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url, "EYRIE_SERVE_DEADLINE_S": "0.5"}
    result = subprocess.run([str(BIN / "eyrie"), "serve", "--model", str(TINY), "--port", str(free_port())],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "did not answer" in result.stderr and "within 0.5 s" in result.stderr


def test_vllm_command_line(monkeypatch):
    monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fake_vllm'}:{os.environ['PATH']}")  # a GPU image's `vllm`
    monkeypatch.setenv("EYRIE_SERVER", "vllm")
    monkeypatch.setenv("EYRIE_TENSOR_PARALLEL_SIZE", "8")
    monkeypatch.setenv("EYRIE_REASONING_PARSER", "kimi_k2")
    monkeypatch.setenv("EYRIE_MAX_MODEL_LEN", "16384")
    monkeypatch.setenv("EYRIE_VLLM_ARGS", "--trust-remote-code --gpu-memory-utilization 0.92")
    settings = load_settings(port=8000, host="0.0.0.0")
    assert command(settings, "/models/kimi") == [
        "vllm", "serve", "/models/kimi", "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "8", "--reasoning-parser", "kimi_k2", "--max-model-len", "16384",
        "--trust-remote-code", "--gpu-memory-utilization", "0.92"]
    assert health_path("vllm") == "/v1/models" and health_path("transformers") == "/health"


def test_payloads_outside_the_schema_are_rejected_unexecuted(env):
    conn = connect(env["EYRIE_REDIS_URL"])
    job = queue(conn, "generate").enqueue("eyrie_generator.shard.run_generate_shard",
                                          {"run": "../etc", "shard": -1, "rm": "-rf"}, job_id="evil")
    eyrie("worker", "generate", "--burst", env=env)
    job = Job.fetch("evil", connection=conn, serializer=JSONSerializer)
    assert job.get_status().value == "failed"
    assert "ValidationError" in job.latest_result().exc_string
    stored = json.loads(zlib.decompress(conn.hget("rq:job:evil", "data")))  # JSON, never a pickle
    assert stored[2] == [{"run": "../etc", "shard": -1, "rm": "-rf"}]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_jobs_that_are_not_ours_or_not_json_fail_unexecuted(env, tmp_path):
    """Whoever can write to Redis cannot make a worker run a function of their choosing, and a
    payload that is not JSON fails its job without stopping the worker."""
    from rq import Callback

    conn = connect(env["EYRIE_REDIS_URL"])
    q = queue(conn, "generate")
    marker = tmp_path / "pwned"
    q.enqueue("os.system", f"touch {marker}", job_id="not-ours")
    q.enqueue("eyrie_generator.shard.run_generate_shard", {"run": "x", "shard": 0}, job_id="not-json")
    conn.hset("rq:job:not-json", "data", zlib.compress(b"\x80\x04 a pickle, say"))
    q.enqueue("eyrie_generator.shard.run_generate_shard", {"run": "x", "shard": 0}, job_id="bad-callback",
              on_failure=Callback("os.abort"))
    q.enqueue("eyrie_generator.shard.run_generate_shard", {"run": "../x", "shard": 0}, job_id="after")
    eyrie("worker", "generate", "--burst", env=env)  # exits 0: the worker outlived them all

    assert not marker.exists()
    errors = {job_id: Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
              for job_id in ("not-ours", "not-json", "after")}
    assert "'os.system' is not an eyrie task; refused unexecuted" in errors["not-ours"].exc_string
    assert "DeserializationError" in errors["not-json"].exc_string
    assert "ValidationError" in errors["after"].exc_string  # the next job still ran, and was checked
    assert set(q.failed_job_registry.get_job_ids()) >= {"not-ours", "not-json", "bad-callback", "after"}
