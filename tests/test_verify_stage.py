"""Where the verify stage runs and when it does not: its own queue, worked only where vLLM is; a
run whose verify cannot run says why and how (never skipped in silence); its task time budget
comes from the run's plan. Real Redis, real `eyrie worker` processes."""

import subprocess
import time

import redis

from conftest import BIN, eyrie, stop, tiny_run_config, wait_for
from eyrie.runs.pipeline import load_config
from eyrie.stages import VERIFY, queues
from eyrie.stages.verify import MIN_VERIFY_TOK_S, verify_skipped, verify_timeout_s
from eyrie.work import progress
from eyrie.work.queue import workers_on


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


def test_verifys_time_budget_grows_with_its_plan(env, tmp_path, monkeypatch):
    """Per pass (the target alone, then each K): the serve deadline and 3x the greedy tokens at the
    measured rate (nothing generated here: the floor)."""
    for name, value in {**env, "EYRIE_SERVE_DEADLINE_S": "100"}.items():
        monkeypatch.setenv(name, value)
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])

    class Manifest:  # the fields verify_timeout_s reads, as a planned run has them
        class train:
            heldout_samples = 30

        class generate:
            class sampling:
                max_tokens = 64

        class dataset:
            row_start, row_end = 0, 306

    from eyrie.runs import pipeline

    small = load_config(tiny_run_config(tmp_path, "s", verify={"prompts": 10, "ks": [3]}))
    large = load_config(tiny_run_config(tmp_path, "l", verify={"prompts": 10, "ks": [3, 5],
                                                                "benchmarks": ["gsm8k", "mt-bench"]}))
    assert verify_timeout_s(conn, small, Manifest) == int(2 * (100 + 3 * 10 * 64 / MIN_VERIFY_TOK_S))
    assert verify_timeout_s(conn, large, Manifest) == int(3 * (100 + 3 * 30 * 64 / MIN_VERIFY_TOK_S))
    # a measured generation rate (its progress in Redis) replaces the floor: a far shorter budget
    progress.report(conn, "s", "generate", "0", started=time.time(), tokens=0)
    time.sleep(0.2)
    progress.report(conn, "s", "generate", "0", started=time.time(), tokens=100_000)
    assert 2 * 100 <= verify_timeout_s(conn, small, Manifest) < 2 * (100 + 3 * 10 * 64 / 1000)
