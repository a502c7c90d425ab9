"""A worker and its Redis (issue 41, item 11): a worker starting while its Redis is down waits for it
(EYRIE_REDIS_WAIT_S, with backoff, saying so) as a running one rides out a Redis restart, then takes
its tasks; a stop (SIGTERM) ends within its bound (worker_loop.STOP_S) whether Redis answers, is gone
(killed) or hangs (SIGSTOPped). Real `eyrie worker` processes, a redis-server of each test's own."""

import os
import shutil
import signal
import subprocess
import time

import pytest
import redis

from eyrie.stages import GENERATE
from eyrie.work.queue import _enqueue, job_state
from eyrie.work.worker_loop import STOP_S
from tests.support.harness import BIN, OFFLINE, wait_for
from tests.support.processes import free_port

pytestmark = pytest.mark.integration


class OwnRedis:
    """A redis-server on a free port that the test starts, kills or freezes."""

    def __init__(self, data):
        self.port, self.data, self.proc = free_port(), data, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.data)],
                                     stdout=subprocess.DEVNULL)
        wait_for(self.pings, "redis-server to answer", timeout=30, every=0.05)

    def pings(self) -> bool:
        try:
            return redis.Redis(port=self.port).ping()
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen one dies too
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path)
    yield server
    server.kill()


@pytest.fixture
def start_worker(own_redis, tmp_path):
    """`eyrie worker generate` on the test's Redis, logging to a file; killed at the end if still up."""
    procs = []

    def start() -> tuple[subprocess.Popen, object]:
        log = tmp_path / f"worker-{len(procs)}.log"
        env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": own_redis.url,
               "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_CACHE_DIR": str(tmp_path / "cache")}
        proc = subprocess.Popen([str(BIN / "eyrie"), "worker", "generate"], env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc, lambda: log.read_text(errors="replace")

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_worker_started_while_its_redis_is_down_waits_for_it_and_takes_a_task(own_redis, start_worker):
    worker, log = start_worker()
    wait_for(lambda: "does not answer" in log() or worker.poll() is not None, "the worker to find Redis down", 60)
    time.sleep(3)  # a few of its retries
    assert worker.poll() is None, log()  # waiting, not gone ("cannot reach Redis ... Fix: start redis-server")
    assert "waiting up to" in log() and "EYRIE_REDIS_WAIT_S" in log(), log()

    own_redis.start()
    conn = redis.Redis.from_url(own_redis.url)
    task = GENERATE.task_id("late-redis")
    _enqueue(conn, GENERATE.queue, GENERATE.func, {}, task, 60)  # an empty payload: the task fails at once
    wait_for(lambda: job_state(conn, task) not in ("queued", None), "the worker to take the task", 60)
    assert worker.poll() is None, log()


def _listening(worker, log) -> None:
    wait_for(lambda: "Listening on" in log() or worker.poll() is not None, "the worker to listen", 60)
    assert worker.poll() is None, log()
    time.sleep(2)  # its scheduler started, its first dequeue under way


def _stops_within(worker, bound: float) -> float:
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(bound)
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic() - started


def test_a_worker_sigtermed_with_its_redis_gone_stops_within_its_bound_saying_so(own_redis, start_worker):
    """Before: the stop sat in RQ's teardown, each of its Redis commands retried for a minute and
    more; 150 s after the SIGTERM the worker was still there."""
    own_redis.start()
    worker, log = start_worker()
    _listening(worker, log)
    own_redis.kill()
    time.sleep(2)
    took = _stops_within(worker, STOP_S + 5)
    assert took <= STOP_S, log()
    assert worker.returncode == 0 and "stopped on request" in log() and "Redis did not answer" in log(), log()
    assert "internal error" not in log() and "Traceback" not in log(), log()


def test_a_worker_sigtermed_with_its_redis_hung_ends_within_its_bound_saying_so(own_redis, start_worker):
    """Redis frozen (SIGSTOP: connections accepted, nothing answered): a Redis command waits for ever,
    so the bound itself ends the worker."""
    own_redis.start()
    worker, log = start_worker()
    _listening(worker, log)
    own_redis.proc.send_signal(signal.SIGSTOP)
    took = _stops_within(worker, STOP_S + 10)
    assert took <= STOP_S + 2, log()  # the bound, and the moment its thread takes to end the process
    assert f"did not end within {STOP_S:g} s" in log(), log()
