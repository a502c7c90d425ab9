"""The control API as a live `eyrie api` process against real Redis and a real store: auth, 404/422,
status equal to the CLI's, cancel and retry on a live run, /metrics parsed by Prometheus' own parser,
and a schemathesis fuzz run against the published OpenAPI schema (no 500s)."""

import json
import os
import subprocess
import tempfile
import time

import pytest
import redis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from prometheus_client.parser import text_string_to_metric_families
from rq.serializers import JSONSerializer
from schemathesis.checks import not_a_server_error

from eyrie.core.config import load_settings
from eyrie.stages.run_config import stored_config
from eyrie.data.store import open_store
from eyrie.work import keys
from eyrie.work.queue import EyrieJob

from tests.support.harness import BIN, OFFLINE, ROOT, TINY, eyrie, start_worker, wait_for, wait_http
from tests.support.processes import free_port, stop

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DATASET_ROOTS = f"{tempfile.gettempdir()},{ROOT / 'tests' / 'data'}"  # tests' prompt files, tmp_path


def start_api(env: dict, **extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(BIN / "eyrie"), "api", "--port", str(port)],
                            env={**env, "EYRIE_API_TOKEN": TOKEN, "EYRIE_API_DATASET_ROOTS": DATASET_ROOTS,
                                 **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", proc=proc)
    return proc, url


@pytest.fixture
def api(env):
    procs = []

    def start(**extra):
        proc, url = start_api(env, **extra)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        stop(proc)
        assert TOKEN not in proc.stdout.read(), "the token must never be logged"


def prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n")
    return str(path)


def run_config(run: str, source: str, **generate) -> dict:
    return {"run": run, "target": {"model": str(TINY)}, "dataset": {"source": source},
            "generate": {"concurrency": 2, "max_tokens": 8, **generate}, "verify": {"enabled": False}}


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_auth_reads_and_writes(api):
    url = api()
    body = run_config("authz", "nowhere.jsonl")
    assert requests.post(f"{url}/runs", json=body).status_code == 401
    assert requests.post(f"{url}/runs", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert requests.get(f"{url}/runs").status_code == 401  # reads are closed by default
    assert requests.get(f"{url}/runs", headers=AUTH).json() == []
    assert requests.get(f"{url}/healthz").json() == {"ok": True}
    opened = api(EYRIE_API_OPEN_READS="true")
    assert requests.get(f"{opened}/runs").status_code == 200
    assert requests.post(f"{opened}/runs/x/cancel").status_code == 401
    no_token = api(EYRIE_API_TOKEN="")
    refused = requests.post(f"{no_token}/runs/x/retry", headers=AUTH)
    assert refused.status_code == 403 and "EYRIE_API_TOKEN" in refused.json()["detail"]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_the_api_reads_local_datasets_only_under_its_roots(env, api, stub_server, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir(), outside.mkdir()
    secret = prompts(outside / "private.jsonl", 3)
    (allowed / "link.jsonl").symlink_to(secret)
    url = api(EYRIE_API_DATASET_ROOTS=str(allowed), EYRIE_INFERENCE_URL=stub_server(), EYRIE_SERVER="vllm")
    for i, source in enumerate([secret, f"{allowed}/../outside/private.jsonl", str(allowed / "link.jsonl"),
                                "/etc/passwd", str(outside)]):
        refused = requests.post(f"{url}/runs", json=run_config(f"out{i}", source), headers=AUTH)
        assert refused.status_code == 400, (source, refused.text)
        assert "EYRIE_API_DATASET_ROOTS" in refused.json()["detail"] + refused.json()["fix"], source
    hub = requests.post(f"{url}/runs", json=run_config("hub", "someone/some-dataset"), headers=AUTH)
    assert hub.status_code == 400 and "EYRIE_API_DATASET_ROOTS" not in hub.json()["detail"]  # offline: no hub
    inside = requests.post(f"{url}/runs?stage=generate", json=run_config("in", prompts(allowed / "p.jsonl", 3)),
                           headers=AUTH)
    assert inside.status_code == 202 and inside.json()["planning"] == "plan-generate-in-00000"
    closed = api(EYRIE_API_DATASET_ROOTS="")  # the default: no local dataset through the API
    refused = requests.post(f"{closed}/runs", json=run_config("in2", str(allowed / "p.jsonl")), headers=AUTH)
    assert refused.status_code == 400 and "EYRIE_API_DATASET_ROOTS (none set" in refused.json()["detail"]
    assert redis.Redis.from_url(env["EYRIE_REDIS_URL"]).smembers(keys.ACTIVE_PIPELINES) == {b"in"}  # the one started


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_unknown_runs_404_and_bad_bodies_422_naming_the_field(env, api):
    url = api()
    for path in ("/runs/nope", "/runs/nope/manifest", "/runs/nope/errors"):
        missing = requests.get(f"{url}{path}", headers=AUTH)
        assert missing.status_code == 404 and "unknown run 'nope'" in missing.json()["detail"], path
    for action in ("cancel", "retry"):
        assert requests.post(f"{url}/runs/nope/{action}", headers=AUTH).status_code == 404
    assert requests.get(f"{url}/runs/..bad", headers=AUTH).status_code == 422
    bad = run_config("x", "d.jsonl", concurency=8)
    bad["extract"] = {"dtype": "fp16"}
    result = requests.post(f"{url}/runs", json=bad, headers=AUTH)
    assert result.status_code == 422
    locs = {tuple(e["loc"]) for e in result.json()["detail"]}
    assert ("body", "generate", "concurency") in locs and ("body", "extract", "dtype") in locs
    named = requests.post(f"{url}/runs", json={**run_config("../evil", "d.jsonl")}, headers=AUTH)
    assert named.status_code == 422 and named.json()["detail"][0]["loc"] == ["body", "run"]
    missing_data = requests.post(f"{url}/runs", json=run_config("nodata", "/no/such.jsonl"), headers=AUTH)
    assert missing_data.status_code == 400 and "such.jsonl" in missing_data.json()["detail"]
    assert not redis.Redis.from_url(env["EYRIE_REDIS_URL"]).smembers(keys.ACTIVE_PIPELINES)  # nothing left


def _steady(status: dict) -> dict:
    """A run's status but its stages and the server's heartbeat (`inference.updated_at`: republished while
    it serves, so two reads seconds apart may differ)."""
    inference = status["inference"] and {k: v for k, v in status["inference"].items() if k != "updated_at"}
    return {k: v for k, v in status.items() if k != "stages"} | {"inference": inference}


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_cancel_and_retry_a_live_run_with_status_and_metrics(env, api, stub_server, tmp_path):
    stub = stub_server(latency=0.4, tokens=6)
    env = {**env, "EYRIE_INFERENCE_URL": stub, "EYRIE_SERVER": "vllm"}
    url = api(EYRIE_INFERENCE_URL=stub, EYRIE_SERVER="vllm")
    started = requests.post(f"{url}/runs", json=run_config("live", prompts(tmp_path / "p.jsonl", 40),
                                                           shard_size=4), headers=AUTH)
    assert started.status_code == 202 and started.json()["planning"] == "plan-generate-live-00000"
    worker = start_worker(env, burst=False)  # plans the run (the first task on its queue), then generates
    try:
        status = lambda: requests.get(f"{url}/runs/live", headers=AUTH).json()  # noqa: E731
        wait_for(lambda: status()["stages"]["generate"]["shards_done"] >= 1)
        cancelled = requests.post(f"{url}/runs/live/cancel", headers=AUTH).json()
        assert cancelled["cancelled"] and len(cancelled["cancelled"]) + len(cancelled["stopped"]) <= 10
        wait_for(lambda: status()["stages"]["generate"]["state"] == "cancelled", timeout=60)
        frozen = status()["stages"]["generate"]["shards_done"]
        time.sleep(3)
        assert status()["stages"]["generate"]["shards_done"] == frozen < 10  # nothing more runs
        assert status()["cancelled"] and "cancelled" in eyrie("runs", env=env).stdout

        retried = requests.post(f"{url}/runs/live/retry", headers=AUTH).json()
        assert set(cancelled["cancelled"]) <= set(retried["requeued"])
        wait_for(lambda: status()["stages"]["generate"]["state"] == "done", timeout=180)
        wait_for(lambda: status()["pipeline"]["tasks"]["plan-extract"]["state"] == "queued")  # the pipeline moved on
        final = status()
        assert final["cancelled"] is None and final["stages"]["generate"]["done"] == 40
        [generate] = requests.get(f"{url}/runs/live/audit", headers=AUTH).json()  # cancelled, retried: once each
        assert (generate["samples_in"], generate["done"], generate["duplicated"], generate["lost"]) == (40, 40, 0, 0)
        assert requests.get(f"{url}/runs/nope/audit", headers=AUTH).status_code == 404
        cli = json.loads(eyrie("status", "live", "--json", env=env).stdout)
        assert _steady(cli) == _steady(final)
        assert cli["stages"]["generate"]["done"] == final["stages"]["generate"]["done"]
        check_metrics(url)
        listed = json.loads(eyrie("runs", "--json", env=env).stdout)
        assert [r["run"] for r in listed] == ["live"] == [r["run"] for r in requests.get(f"{url}/runs",
                                                                                      headers=AUTH).json()]
        manifest = requests.get(f"{url}/runs/live/manifest", headers=AUTH).json()
        assert manifest["run"] == "live" and len(manifest["generate_shards"]) == 10
        assert "live" in eyrie("show", "live", env=env).stdout
    finally:
        os.killpg(worker.pid, 9)


def check_metrics(url: str) -> None:
    text = requests.get(f"{url}/metrics", headers=AUTH).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("eyrie_samples", (("outcome", "done"), ("run", "live"), ("stage", "generate")))] == 40
    assert samples[("eyrie_tokens", (("run", "live"), ("stage", "generate")))] == 240
    assert samples[("eyrie_run_state", (("run", "live"), ("state", "in_progress")))] == 1
    assert samples[("eyrie_queue_jobs", (("queue", "extract"), ("state", "queued")))] == 1
    assert ("eyrie_workers", (("queue", "generate"),)) in samples
    assert samples[("eyrie_bytes_stored", (("run", "live"), ("stage", "generate")))] > 0


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_stage_started_through_the_api_keeps_how_its_body_serves_the_target(env, api, tmp_path):
    """POST /runs?stage=generate keeps the body's `serve` (at 40c2bde it was dropped for the API
    host's defaults: TP 1, no parser, no flags, which then became the reuse fingerprint)."""
    url = api()
    serve = {"tensor_parallel_size": 8, "reasoning_parser": "qwen3", "max_model_len": 4096,
             "extra_args": ["--dtype", "float32"]}
    body = {**run_config("served", prompts(tmp_path / "p.jsonl", 3)), "serve": serve}
    assert requests.post(f"{url}/runs?stage=generate", json=body, headers=AUTH).status_code == 202
    kept = stored_config(open_store(load_settings()), "served")
    assert kept.stages == ["generate"] and kept.serve.model_dump(include=set(serve)) == serve


# ---------------------------------------------------------------------------------------------
# schemathesis


@pytest.fixture(scope="module")
def fuzz_api(redis_server, tmp_path_factory):
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_server,
           "EYRIE_STORE_URL": f"file://{tmp_path_factory.mktemp('fuzz-store')}"}
    proc, url = start_api(env)
    yield url
    stop(proc)


def test_no_server_errors_on_any_input(fuzz_api):
    """Every operation of the published schema, with generated valid and invalid inputs: the same
    12 per operation in CI (derandomized: a CI run is repeatable); EYRIE_FUZZ_EXAMPLES=N for N
    fresh random ones (a deeper sweep, on demand)."""
    deeper = int(os.environ.get("EYRIE_FUZZ_EXAMPLES", "0"))
    schema = schemathesis.openapi.from_url(f"{fuzz_api}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/runs", "/runs/{name}", "/runs/{name}/cancel", "/metrics"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=deeper or 12, derandomize=not deeper, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), database=None)
        def call(case):
            case.call_and_validate(base_url=fuzz_api, headers=AUTH, checks=[not_a_server_error], timeout=120)

        call()


def test_a_value_the_stage_refuses_is_a_422_naming_it(fuzz_api):
    """Found by schemathesis in CI: ttt_steps over 16 passed the body's schema, then failed (500)."""
    body = {"run": "ttt", "target": {"model": "m"}, "dataset": {"source": "d"}, "train": {"ttt_steps": 103995}}
    reply = requests.post(f"{fuzz_api}/runs?stage=train", json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "train", "ttt_steps"]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_cli_cancel_retry_logs_watch(env, stub_server, tmp_path):
    env = {**env, "EYRIE_INFERENCE_URL": stub_server(tokens=4), "EYRIE_SERVER": "vllm"}
    eyrie("generate", "--dataset", prompts(tmp_path / "p.jsonl", 6), "--run", "cli", "--shard-size", "3", env=env)
    assert "2 waiting tasks removed" in eyrie("cancel", "cli", env=env).stdout
    assert json.loads(eyrie("runs", "--json", env=env).stdout)[0]["state"] == "cancelled"
    assert json.loads(eyrie("status", "cli", "--json", env=env).stdout)["stages"]["generate"]["state"] == "cancelled"
    assert "2 tasks requeued" in eyrie("retry", "cli", env=env).stdout
    eyrie("worker", "generate", "--burst", env=env)
    assert eyrie("watch", "cli", env=env, timeout=60).returncode == 0
    assert "no errors" in eyrie("logs", "cli", env=env).stdout
    assert json.loads(eyrie("logs", "cli", "--json", env=env).stdout) == []
    shown = eyrie("show", "cli", env=env).stdout
    assert "dataset" in shown and "2 shards" in shown
    assert json.loads(eyrie("show", "cli", "--json", env=env).stdout)["run"] == "cli"
    unknown = eyrie("cancel", "nope", env=env, check=False)
    assert unknown.returncode == 1 and "unknown run 'nope'" in unknown.stderr


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_one_stage_only(env, api, stub_server, tmp_path):
    stub = stub_server(tokens=4)
    url = api(EYRIE_INFERENCE_URL=stub, EYRIE_SERVER="vllm")
    body = run_config("single", prompts(tmp_path / "p.jsonl", 5))
    bad = requests.post(f"{url}/runs?stage=evaluate", json=body, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "stage"]
    early = requests.post(f"{url}/runs?stage=extract", json=body, headers=AUTH)
    assert early.status_code == 404 and "unknown run 'single'" in early.json()["detail"]
    started = requests.post(f"{url}/runs?stage=generate", json=body, headers=AUTH)
    assert started.status_code == 202 and started.json() == {"run": "single", "stage": "generate", "enqueued": 0,
                                                             "planning": "plan-generate-single-00000"}
    planning = requests.get(f"{url}/runs/single", headers=AUTH).json()  # answered before any row was read
    assert planning["created_at"] is None and planning["stages"]["generate"]["waiting_for"] == ["planning"]
    assert planning["stages"]["generate"]["jobs"] == {"queued": 1}
    worker = eyrie("worker", "generate", "--burst", env={**env, "EYRIE_INFERENCE_URL": stub, "EYRIE_SERVER": "vllm"})
    assert "plan-generate-single-00000" in worker.stdout + worker.stderr  # planned by the generator's worker
    status = requests.get(f"{url}/runs/single", headers=AUTH).json()
    assert status["stages"]["generate"]["state"] == "done" and status["pipeline"]["stages"] == ["generate"]
    assert "extract" not in status["stages"]  # nothing followed by itself: a run of generate alone

    extract = requests.post(f"{url}/runs?stage=extract", json={**body, "extract": {"layers": [2, 4, 5]}}, headers=AUTH)
    assert extract.status_code == 202 and extract.json() == {"run": "single", "stage": "extract", "enqueued": 0,
                                                             "planning": "plan-extract-single-00000"}
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])  # not planned by the API: its task, from the config kept
    task = EyrieJob.fetch("plan-extract-single-00000", connection=conn, serializer=JSONSerializer)
    assert list(task.args) == [{"run": "single"}] and task.origin == "eyrie-extract"
    kept = stored_config(open_store(load_settings()), "single")
    assert kept.stages == ["generate", "extract"] and kept.extract.layers == [2, 4, 5]
    assert "extract" not in requests.get(f"{url}/runs/single", headers=AUTH).json()["stages"]
    worker = eyrie("worker", "extract", "--burst", env=env, timeout=600)
    assert "plan-extract-single-00000" in worker.stdout + worker.stderr  # planned by the extractor's worker
    extracted = requests.get(f"{url}/runs/single", headers=AUTH).json()["stages"]["extract"]
    assert extracted["state"] == "done" and extracted["done"] == 5
    manifest = requests.get(f"{url}/runs/single/manifest", headers=AUTH).json()
    assert manifest["extract"]["aux_layers"] == [2, 4, 5]
