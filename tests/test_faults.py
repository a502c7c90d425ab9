"""The fault suite: the real pipeline on the tiny target (`eyrie run`, one `eyrie worker` process
per stage, transformers serve, redis-server, SeaweedFS's S3 server) while faults are injected: workers
SIGKILLed mid-task, Redis killed, S3 away for 30 s, a lossy network to the inference server, a
corrupted object, a run started twice, a budget too small. Each scenario ends with `eyrie audit`
(every sample from the store: in, done, skipped, failed, duplicated, lost) and adds its figures
to docs/faults.md; every one must show 0 lost and 0 duplicated."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import date
from pathlib import Path

import pytest
import redis

from conftest import BIN, ROOT, S3_KEYS, TRAIN_PROMPTS, Workers, eyrie, free_port, stop, tiny_run_config, wait_for, wait_http
from eyrie.data.manifest import Layout, ShardManifest
from eyrie.work import progress

DOCS = ROOT / "docs"
ROWS = 48


# --- the parts -------------------------------------------------------------------------------

FAULT_RUN = {"dataset": {"limit": ROWS}, "generate": {"max_tokens": 32, "shard_size": 16, "request_timeout_s": 60}}


def run_config(tmp_path: Path, run: str, **sections) -> str:
    return tiny_run_config(tmp_path, run, FAULT_RUN, **sections)


def fault_proxy(mode: str, upstream: str, *args: str) -> tuple[subprocess.Popen, str]:
    """tests/fault_proxy.py in front of `upstream`: the process and the URL to use instead."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_proxy.py"), mode, "--port", str(port),
                             "--upstream", upstream, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/_faults" if mode == "http" else f"{url}/", proc=proc)
    return proc, url


def status(run: str, env: dict) -> dict:
    return json.loads(eyrie("status", run, "--json", env=env).stdout)


def stage_done(run: str, env: dict, stage: str = "train") -> bool:
    """Train done: the drafter is exported."""
    return status(run, env)["stages"].get(stage, {}).get("state") == "done"


def audit(run: str, env: dict) -> list[dict]:
    result = eyrie("audit", run, "--json", env=env, check=False)
    assert result.returncode in (0, 3), result.stderr
    return json.loads(result.stdout)


def store_root(env: dict) -> Path:
    return Path(env["EYRIE_STORE_URL"].removeprefix("file://"))


def stored_parts(env: dict, run: str, stage: str) -> list[Path]:
    """Parts of a stage's tasks still running (file store: a directory listing, cheap to poll)."""
    return list((store_root(env) / "runs" / run / stage / "parts").glob("shard-*/part-*"))


# --- figures ---------------------------------------------------------------------------------

FIGURES: dict[str, list[dict]] = {}


def record(scenario: str, figures: list[dict], note: str, stages: tuple[str, ...] | None = None) -> None:
    rows = [{**f, "note": note} for f in figures if stages is None or f["stage"] in stages]
    FIGURES[scenario] = rows
    for row in rows:
        assert row["lost"] == 0 and row["duplicated"] == 0, f"{scenario}: {row}"


@pytest.fixture(scope="module", autouse=True)
def faults_table():
    """docs/faults.json keeps every scenario's latest figures; docs/faults.md is written from it."""
    yield
    if not FIGURES:
        return
    data_path = DOCS / "faults.json"
    table = json.loads(data_path.read_text()) if data_path.exists() else {}
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, Python {sys.version.split()[0]}"
    for scenario, rows in FIGURES.items():
        table[scenario] = {"rows": rows, "date": date.today().isoformat(), "machine": machine}
    data_path.write_text(json.dumps(table, indent=2) + "\n")
    (DOCS / "faults.md").write_text(render(table))


def render(table: dict) -> str:
    lines = ["# Fault suite: figures", "",
             "Written by `make faults` (tests/test_faults.py, also part of `make test`): the real pipeline on",
             f"the tiny target ({ROWS} prompts) with real processes, one fault per scenario. Figures are",
             "`eyrie audit` of the run's store afterwards.", "",
             "| scenario | stage | in | done | skipped | failed | duplicated | lost | what happened |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for scenario, entry in table.items():
        for row in entry["rows"]:
            lines.append(f"| {scenario} | {row['stage']} | {row['samples_in']} | {row['done']} | {row['skipped']} "
                         f"| {row['failed']} | {row['duplicated']} | {row['lost']} | {row['note']} |")
    runs = sorted({(e["date"], e["machine"]) for e in table.values()})
    lines += ["", "Run on: " + "; ".join(f"{d} ({m})" for d, m in runs), ""]
    return "\n".join(lines)


# --- scenarios -------------------------------------------------------------------------------

@pytest.fixture
def slow_inference(tiny_server):
    """The tiny server answering each request after 1 s: a generate shard at one request in flight
    takes 16 s, long enough to be caught with a part stored (parts go out every 10 s)."""
    proc, url = fault_proxy("http", tiny_server.url, "--rate", "0", "--delay-s", "1")
    yield url
    stop(proc)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_workers_sigkilled_mid_task_in_every_stage(env, slow_inference, tmp_path, workers):
    """Each stage's worker is SIGKILLed in the middle of a task and a new one started at once: the
    new worker takes the dead one's task over (its lease lapses) and finishes it from what was
    stored; the trainer resumes from its last checkpoint."""
    workers.env = env = {**env, "EYRIE_EXTRACT_BATCH_TOKENS": "64",  # one sample a batch: a part each
                         "EYRIE_INFERENCE_URL": slow_inference}
    workers.start("generate", "extract", "train")
    eyrie("run", "--config", run_config(tmp_path, "kill", generate={"concurrency": 1}), env=env)

    def generate_part_stored():
        parts = stored_parts(env, "kill", "generate")
        assert parts or not stage_done("kill", env, "generate"), "generate finished with no part seen: proves nothing"
        return parts

    wait_for(generate_part_stored, "a generate task with a part stored", timeout=300, every=0.2)
    workers.kill("generate")
    assert status("kill", env)["stages"]["generate"]["state"] != "done", "finished before the kill: proves nothing"
    workers.start("generate")

    wait_for(lambda: stored_parts(env, "kill", "extract"), "an extract task with a part stored", every=0.01, timeout=600)
    workers.kill("extract")
    killed_mid_task = stored_parts(env, "kill", "extract")
    workers.start("extract")

    layout = Layout("kill")
    first_checkpoint = store_root(env) / layout.checkpoint_manifest("0")
    wait_for(first_checkpoint.exists, "the trainer's first checkpoint", every=0.05, timeout=600)
    workers.kill("train")
    assert not (store_root(env) / layout.drafter_manifest).exists(), "trained before the kill: proves nothing"
    workers.start("train")

    wait_for(lambda: stage_done("kill", env), "the drafter exported after the restarts", timeout=600)
    assert killed_mid_task, "the extract task had finished before the kill: proves nothing"
    train = status("kill", env)["stages"]["train"]
    assert any("resuming from checkpoint" in note for note in train["notes"]), train["notes"]
    figures = {f["stage"]: f for f in audit("kill", env)}
    record("generator worker SIGKILLed mid-task", [figures["generate"]],
           "new worker took the task over when the lease lapsed; stored records kept")
    record("extractor worker SIGKILLed mid-task", [figures["extract"]],
           f"killed with {len(killed_mid_task)} part(s) stored; new worker finished the shard")
    record("trainer SIGKILLed after its first checkpoint", [figures["train"]],
           "new worker resumed from the last stored checkpoint")


@pytest.fixture
def aof_redis(tmp_path):
    """A redis-server of this test's own, with the append-only file on, that the test can kill."""
    port, data = free_port(), tmp_path / "redis-aof"
    data.mkdir()
    args = [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
            "--appendonly", "yes", "--appendfsync", "always", "--save", ""]

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        wait_for(lambda: _pings(port), "redis-server to answer", timeout=30, every=0.05)
        return proc

    server = {"proc": start(), "start": start, "url": f"redis://127.0.0.1:{port}/0"}
    yield server
    stop(server["proc"])


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port).ping()
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_redis_killed_and_restarted_mid_run(env, tiny_server, aof_redis, tmp_path, workers):
    """SIGKILL of redis-server while generate runs (queued tasks waiting), restarted on its AOF:
    the workers and the callbacks reconnect; no queued task is lost; the run completes."""
    env = {**env, "EYRIE_REDIS_URL": aof_redis["url"], "EYRIE_INFERENCE_URL": tiny_server.url}
    workers.env = env
    workers.start("generate", "extract", "train")
    eyrie("run", "--config", run_config(tmp_path, "redis", generate={"shard_size": 8}), env=env)
    wait_for(lambda: status("redis", env)["stages"]["generate"]["shards_done"], "a first generate shard", timeout=600)
    queued = status("redis", env)["stages"]["generate"]["jobs"].get("queued", 0)
    aof_redis["proc"].kill()
    aof_redis["proc"].wait()
    time.sleep(2)
    aof_redis["proc"] = aof_redis["start"]()

    wait_for(lambda: stage_done("redis", env), "the drafter exported after Redis came back", timeout=600)
    record("Redis SIGKILLed mid-run, restarted on its AOF", audit("redis", env),
           f"{queued} generate task(s) were queued at the kill; all ran")


@pytest.fixture
def s3_behind_relay(s3_server):
    """The S3 server behind a TCP relay the test can take down: S3 'away' is the relay refusing and
    cutting connections (the session's server, shared by other tests, stays up)."""
    proc, url = fault_proxy("tcp", s3_server.removeprefix("http://"))
    yield proc, url
    stop(proc)


def test_s3_away_for_30_s_mid_upload(redis_url, tiny_server, s3_behind_relay, tmp_path, monkeypatch):
    from conftest import OFFLINE

    relay, endpoint = s3_behind_relay
    bucket = f"faults-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"s3://{bucket}/s3-away",
           "EYRIE_S3_ENDPOINT": endpoint, **S3_KEYS,
           "EYRIE_RETRY_BACKOFF_S": "0.05", "EYRIE_EXTRACT_BATCH_TOKENS": "64"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    workers = Workers(env, tmp_path)
    try:
        s3_run(env, relay, workers, redis_url)
    finally:
        workers.stop_all()


def s3_run(env: dict, relay: subprocess.Popen, workers: Workers, redis_url: str) -> None:
    workers.start("generate", "extract", "train")
    eyrie("run", "--config", run_config(Path(workers.logs), "s3"), env=env)
    conn = redis.Redis.from_url(redis_url)
    wait_for(lambda: any(e.get("done") for e in progress.read(conn, "s3", "extract").values()),
             "extract writing objects", every=0.01, timeout=600)
    relay.send_signal(signal.SIGUSR1)  # down: connections refused, uploads in flight cut
    time.sleep(30)
    relay.send_signal(signal.SIGUSR2)

    wait_for(lambda: stage_done("s3", env), "the drafter exported after S3 came back", timeout=600)
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store

    store, layout = open_store(load_settings()), Layout("s3")
    for index in range(3):  # every stored sample is whole: its bytes match the recorded sha256
        shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(index)))
        for sample in shard.samples:
            store.get_verified(sample["key"], sample["sha256"])
    retried = {stage: workers.log_text(stage).count("retried in") for stage in ("extract", "train")}
    assert retried["extract"] > 0, retried  # the outage hit the extractor's uploads
    record("S3 server away 30 s mid-upload", audit("s3", env),
           f"S3 calls retried with backoff ({retried['extract']} retries in the extractor, {retried['train']} in "
           "the trainer); every stored object verified whole")


@pytest.fixture
def flaky_inference(tiny_server):
    proc, url = fault_proxy("http", tiny_server.url, "--rate", "0.2", "--hang-s", "20")
    yield url
    stop(proc)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_lossy_network_to_the_inference_server(env, flaky_inference, tmp_path, workers):
    """20% of requests get a 503, hang past the timeout, or lose their connection (before or in
    the middle of the answer): retried; what still fails is recorded with its error."""
    import requests

    env = {**env, "EYRIE_INFERENCE_URL": flaky_inference, "EYRIE_MAX_RETRIES": "1"}
    workers.env = env
    workers.start("generate", "extract", "train")
    eyrie("run", "--config", run_config(tmp_path, "lossy", generate={"request_timeout_s": 5}, train={"epochs": 1}), env=env)
    wait_for(lambda: stage_done("lossy", env), "the drafter exported despite the lossy network", timeout=600)
    faults = requests.get(f"{flaky_inference}/_faults", timeout=5).json()
    assert all(faults.get(kind, 0) > 0 for kind in ("http_503", "hang", "drop", "drop_mid_answer")), faults
    figures = audit("lossy", env)
    failed = figures[0]["failed"]
    manifests = (store_root(env) / "runs/lossy/generate/shards").glob("*.manifest.json")
    shards = [json.loads(p.read_text()) for p in manifests]
    assert sum(sum(s["failure_errors"].values()) for s in shards) == failed  # each with its error
    injected = sum(v for k, v in faults.items() if k not in ("forwarded", "other"))
    record("20% of inference requests fail (503, hang, drop, drop mid-answer)", figures,
           f"{injected} faults injected in {injected + faults.get('forwarded', 0)} requests; one retry each; "
           f"{failed} sample(s) failed twice, recorded with the error")


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_corrupted_object_is_caught_by_its_checksum_and_produced_again(env, tiny_server, tmp_path, workers):
    workers.start("generate", "extract")
    eyrie("run", "--config", run_config(tmp_path, "corrupt"), env=env)
    wait_for(lambda: stage_done("corrupt", env, "extract"), "extract done", timeout=600)
    layout = Layout("corrupt")
    shard = ShardManifest.model_validate(json.loads((store_root(env) / layout.extract_shard_manifest(1)).read_text()))
    victim = store_root(env) / shard.samples[0]["key"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the hidden states
    victim.write_bytes(bytes(data))

    workers.start("train")
    wait_for(lambda: stage_done("corrupt", env), "the drafter exported after the re-extraction", timeout=600)
    log = workers.log_text("train")
    assert "does not match its recorded sha256" in log and "Extract shard 1 is produced again" in log
    record("a stored hidden-state object corrupted (1 byte)", audit("corrupt", env),
           "sha256 mismatch caught by the trainer before use; its extract shard produced again")


@pytest.fixture
def counting_inference(tiny_server):
    proc, url = fault_proxy("http", tiny_server.url, "--rate", "0")
    yield url
    stop(proc)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_run_started_twice_does_its_work_once(env, counting_inference, tmp_path, workers):
    """Two `eyrie run` of one run at the same moment, the generate stage enqueued a third time,
    two workers on each stage: every prompt reaches the inference server once."""
    env = {**env, "EYRIE_INFERENCE_URL": counting_inference}
    workers.env = env
    workers.start("generate", "generate", "extract", "extract", "train")
    path = run_config(tmp_path, "twice", train={"epochs": 1})
    both = [subprocess.Popen([str(BIN / "eyrie"), "run", "--config", path], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    assert [p.wait(120) for p in both] == [0, 0], [p.stdout.read() for p in both]
    eyrie("generate", "--dataset", str(TRAIN_PROMPTS), "--limit", str(ROWS), "--run", "twice", "--shard-size", "16",
          "--max-tokens", "32", "--concurrency", "8", "--timeout", "60", env=env)
    wait_for(lambda: stage_done("twice", env), "the drafter exported", timeout=600)
    import requests

    forwarded = requests.get(f"{counting_inference}/_faults", timeout=5).json().get("forwarded", 0)
    figures = audit("twice", env)
    assert forwarded == figures[0]["done"] + figures[0]["failed"] == ROWS, forwarded
    record("the same run started twice at once, and enqueued a third time", figures,
           f"{forwarded} generation requests for {ROWS} prompts: each sent once")


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_over_its_storage_budget_a_pipeline_stops_before_any_forward_pass(env, tiny_server, tmp_path, workers):
    workers.start("generate", "extract")
    path = run_config(tmp_path, "budget", dataset={"limit": 12}, extract={"budget": "10kB"})
    result = eyrie("run", "--config", path, "--wait", env=env, check=False, timeout=900)
    assert result.returncode == 3
    report = status("budget", env)
    assert report["stages"]["generate"]["state"] == "done" and "extract" not in report["stages"]
    blocked = report["pipeline"]["blocked"]
    assert "10.00 kB" in blocked and "--dtype fp8" in blocked  # refused, with the numbers and the options
    assert not list((store_root(env) / "runs" / "budget").glob("extract/**/*.safetensors"))
    figures = audit("budget", env)
    record("storage budget exceeded", figures, "refused when extract was planned, before any forward pass; "
           "0 hidden-state bytes written")
    # the fix: a bigger budget; extract was not planned, so its section may change on a rerun
    fixed = run_config(tmp_path, "budget", dataset={"limit": 12}, extract={"budget": "1GB"})
    assert "extract started" in eyrie("run", "--config", fixed, env=env).stdout
    wait_for(lambda: stage_done("budget", env, "extract"), "extract after the fix", timeout=600)
    assert status("budget", env)["pipeline"]["blocked"] is None
