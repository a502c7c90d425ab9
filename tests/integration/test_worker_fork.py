"""The generator's worker forks a work horse per task, and nothing of ours is on the network while
it forks: a thread inside getaddrinfo at the fork leaves the work horse glibc's resolver lock held
for good, and the horse hangs on its first Redis connection with its task taken and nothing done
(seen in full runs: a generate task taken, no request sent, the run in progress forever)."""

import os
import threading

import redis
from rq.serializers import JSONSerializer

from eyrie.stages import GENERATE
from eyrie.work import keys
from eyrie.work import worker_loop
from eyrie.work.queue import EyrieJob, _enqueue, queue
from eyrie.work.worker_loop import ForkingWorker, worker_name


def test_the_job_keeper_starts_after_the_fork_not_before(redis_url, monkeypatch):
    conn = redis.Redis.from_url(redis_url)
    job_id = GENERATE.task_id("forked")
    _enqueue(conn, GENERATE.queue, GENERATE.func, {}, job_id, 60)  # an empty payload: the task fails at once
    at_fork, real_fork = [], os.fork

    def fork():
        at_fork.append(sorted(t.name for t in threading.enumerate()))
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    worker = ForkingWorker([queue(conn, GENERATE.queue)], connection=conn, serializer=JSONSerializer,
                           job_class=EyrieJob, name=worker_name("fork-test"))
    kept, keep_alive = [], worker_loop._keep_alive

    def _keep_alive(conn, job_id, stop):
        kept.append(job_id)
        keep_alive(conn, job_id, stop)

    monkeypatch.setattr(worker_loop, "_keep_alive", _keep_alive)
    worker.work(burst=True)
    assert at_fork, "the worker never forked a work horse"
    assert not any("_keep_alive" in name for names in at_fork for name in names), at_fork
    assert kept == [job_id]  # the parent kept the job alive while the horse ran it
    assert not conn.exists(keys.job_alive(job_id))  # and let the key go after


def test_a_burst_worker_sigtermed_as_it_quits_stops_without_an_error(redis_url):
    """SIGTERM that finds a burst worker idle, as it quits (RQ raises StopRequested wherever its
    handler lands, also after its loop): the worker stops, saying so, and `eyrie` reports no
    internal error."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "EYRIE_REDIS_URL": redis_url}
    worker = subprocess.Popen([str(Path(sys.executable).parent / "eyrie"), "worker", "generate", "--burst"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in worker.stdout:
        lines.append(line)
        if "done, quitting" in line:  # the queue is empty: the worker leaves its loop now
            worker.send_signal(signal.SIGTERM)
            break
    output = "".join(lines) + worker.stdout.read()
    assert worker.wait(30) in (0, -signal.SIGTERM), output
    assert "internal error" not in output and "Traceback" not in output, output


def _deadlocked_scheduler() -> None:
    """Stands in for a scheduler process that deadlocked right after its fork: deaf to SIGTERM."""
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_a_stop_kills_a_scheduler_process_that_does_not_end_within_its_bound(redis_url, monkeypatch):
    """RQ joins its scheduler process without a bound; forked from a busy worker it can deadlock (a burst
    train worker hung 20 min after its task, in CI). eyrie's stop gives it SCHEDULER_STOP_S, then kills it."""
    import multiprocessing
    import time
    from types import SimpleNamespace

    monkeypatch.setattr(worker_loop, "SCHEDULER_STOP_S", 1.0)
    conn = redis.Redis.from_url(redis_url)
    worker = ForkingWorker([queue(conn, GENERATE.queue)], connection=conn, serializer=JSONSerializer,
                           job_class=EyrieJob, name=worker_name("generate"))
    process = multiprocessing.get_context("fork").Process(target=_deadlocked_scheduler)
    process.start()
    worker.scheduler = SimpleNamespace(_process=process)  # RQ's scheduler holds its process as `_process`
    started = time.monotonic()
    worker.stop_scheduler()
    assert not process.is_alive() and time.monotonic() - started < 10
