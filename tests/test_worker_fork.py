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
from eyrie.work import queue as work_queue
from eyrie.work.queue import EyrieJob, ForkingWorker, _enqueue, queue, worker_name


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
    kept, keep_alive = [], work_queue._keep_alive

    def _keep_alive(conn, job_id, stop):
        kept.append(job_id)
        keep_alive(conn, job_id, stop)

    monkeypatch.setattr(work_queue, "_keep_alive", _keep_alive)
    worker.work(burst=True)
    assert at_fork, "the worker never forked a work horse"
    assert not any("_keep_alive" in name for names in at_fork for name in names), at_fork
    assert kept == [job_id]  # the parent kept the job alive while the horse ran it
    assert not conn.exists(keys.job_alive(job_id))  # and let the key go after
