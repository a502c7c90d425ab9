"""Where the verify stage runs and when it does not: its own queue, worked only where vLLM is; a
run whose verify cannot run says why and how (never skipped in silence); its task time budget
comes from the run's plan. Real Redis, real `eyrie worker` processes."""

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import redis
import requests

from eyrie.stages.run_config import load_config
from eyrie.stages import VERIFY, queues
from eyrie.stages.verify import verify_skipped, verify_timeout_s
from eyrie.work import progress
from eyrie.work.queue import workers_on
from tests.support.harness import BIN, eyrie, tiny_run_config, wait_for
from tests.support.processes import stop


def test_verify_has_a_queue_of_its_own():
    assert VERIFY.queue == "verify" and "verify" in queues()  # not the trainer's: its image has no vLLM


def test_a_verify_worker_refuses_to_start_without_vllm(env):
    result = eyrie("worker", "verify", "--burst", env={**env, "EYRIE_VLLM_COMMAND": "/nowhere/vllm"}, check=False)
    assert result.returncode != 0
    assert "a verify worker needs vLLM, and '/nowhere/vllm' is not here" in result.stderr
    assert "inference image" in result.stderr


def test_verify_runs_where_a_verify_worker_is_up_and_says_why_it_does_not_elsewhere(env, tmp_path, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    default = load_config(tiny_run_config(tmp_path, "v", verify={"enabled": None}))
    skipped = verify_skipped(conn, default)
    assert skipped["skipped"] == "no worker of the verify queue is up (it runs where vLLM is installed)"
    assert "eyrie worker verify" in skipped["fix"] and "eyrie verify --run v" in skipped["fix"]
    off = load_config(tiny_run_config(tmp_path, "off"))  # verify.enabled: false
    assert verify_skipped(conn, off)["skipped"] == "verify.enabled is false in the run config"
    on = load_config(tiny_run_config(tmp_path, "on", verify={"enabled": True}))
    assert verify_skipped(conn, on) is None  # asked for: it waits for a verify worker

    worker = subprocess.Popen([str(BIN / "eyrie"), "worker", "verify"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: workers_on(conn, "verify"), "the verify worker registered", timeout=60)
        assert verify_skipped(conn, default) is None
    finally:
        stop(worker)


def _planned(run: str, concurrency: int, max_tokens: int, heldout: int = 30):
    """The fields verify_timeout_s reads of a planned run's manifest."""
    return SimpleNamespace(run=run, target=SimpleNamespace(model=f"/models/{run}"),
                           train=SimpleNamespace(heldout_samples=heldout),
                           generate=SimpleNamespace(concurrency=concurrency,
                                                    sampling=SimpleNamespace(max_tokens=max_tokens)))


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_verifys_time_limit_covers_its_passes_on_a_slow_server(env, tmp_path, monkeypatch, stub_server):
    """A server whose every answer takes 0.3 s: generation at 32 in flight reports 32 answers a
    0.3 s, but verify asks 8 at a time and then 1: its limit comes from those rates (generation's
    per request, until a verify of the target has measured its own), never from 32 in flight."""
    monkeypatch.setenv("EYRIE_SERVE_DEADLINE_S", "1")
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    url, tokens, concurrency = stub_server(latency=0.3, tokens=20), 20, 32
    started = time.time()  # the generate stage at 32 in flight on the server, as its task reports it
    progress.report(conn, "slow", "generate", "0", started=started, tokens=0)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: requests.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stub", "messages": [{"role": "user", "content": str(i)}]}).raise_for_status(), range(concurrency)))
    progress.report(conn, "slow", "generate", "0", started=started, tokens=concurrency * tokens)

    config = load_config(tiny_run_config(tmp_path, "slow", verify={"prompts": 8, "ks": [3], "serial_prompts": 8}))
    manifest = _planned("slow", concurrency, tokens)
    from eyrie_trainer.verify import Client, benchmark_result, measured_paces

    started = time.monotonic()  # verify's own pass over the held-out set (8 prompts, 8 then 1 in flight)
    measured = Client(url, "stub").measure({"heldout": [[1, 2, 3]] * 8}, {"heldout": [tokens] * 8}, 8)["heldout"]
    took = time.monotonic() - started  # one pass; verify makes two (the target alone, then K=3)
    serving = 2 * 1  # a vLLM start per pass, within the serve deadline
    limit = verify_timeout_s(conn, config, manifest)
    assert limit - serving >= 2 * took, (limit, took)

    # verify's own rates once it has measured the target: the slowest of its passes, at 8 and at 1
    from eyrie.stages.verify import record_verify_rates

    result = {"benchmarks": {"heldout": benchmark_result(measured, {3: measured}, 8)}}
    record_verify_rates(conn, manifest.target.model, measured_paces(result))  # as the verify task does
    own = verify_timeout_s(conn, config, manifest)
    assert 2 * took <= own - serving <= 4 * 2 * took, (own, took)  # 3x the passes at their measured pace
    other = _planned("slow", concurrency, tokens)
    other.target.model = "/models/another"  # rates are the target's: another's are generation's here
    assert verify_timeout_s(conn, config, other) == limit


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_verifys_time_limit_grows_with_its_plan(env, tmp_path, monkeypatch):
    """More prompts, more sets, more Ks, a set's second turns: a longer limit (nothing measured: the floor rate)."""
    monkeypatch.setenv("EYRIE_SERVE_DEADLINE_S", "100")
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    manifest = _planned("s", 8, 64)
    small = load_config(tiny_run_config(tmp_path, "s", verify={"prompts": 10, "ks": [3]}))
    large = load_config(tiny_run_config(tmp_path, "l", verify={"prompts": 10, "ks": [3, 5],
                                                                "benchmarks": ["gsm8k", "mt-bench"]}))
    assert 2 * 100 < verify_timeout_s(conn, small, manifest) < verify_timeout_s(conn, large, manifest)
    one_turn, two_turns = (verify_timeout_s(conn, load_config(tiny_run_config(
        tmp_path, name, verify={"prompts": 10, "ks": [3], "benchmarks": [name]})), manifest) for name in ("gsm8k", "mt-bench"))
    # answering time, the vLLM starts less: held out + gsm8k is 2 sets' passes, held out + MT-Bench 3 (its second turns)
    assert (two_turns - 2 * 100) * 2 == pytest.approx((one_turn - 2 * 100) * 3, abs=3)
