"""Redis + RQ: connections, JSON-only queues, task enqueueing, workers and per-task leases."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import redis
from redis.lock import Lock
from redis.retry import Retry as RedisRetry
from rq import Callback, Queue, Retry, Worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.core.config import safe_url
from eyrie.core.errors import EyrieError
from eyrie.work import keys
from eyrie.work.cancel import HANDED_BACK, stop_requested
from eyrie.work.kueue import dispatch
from eyrie.work.task_kinds import CALLBACKS, ON_TASK_DONE, TaskKind, queue_name, task_funcs

RETRY_INTERVALS_S = [10, 60, 300]
ADVANCE_TIMEOUT_S = 3600  # planning the next stage reads every record (25k samples: minutes)
LEASE_TTL_S = 15  # a dead worker's task is taken over within this time
HAND_BACKS = 1000  # a task handed back on a worker's stop goes back to its queue at once, this many times at most


class RefusedTask(Exception):
    """A queued job that is not one of ours."""


class EyrieJob(Job):
    """A job that resolves only eyrie's own task functions and callback (eyrie.stages): a payload
    naming anything else (os.system, say) is refused unexecuted, whoever could write to Redis."""

    @property
    def func(self):
        if self.func_name not in task_funcs() or self.instance is not None:
            raise RefusedTask(f"{self.func_name!r} is not an eyrie task; refused unexecuted")
        return super().func

    def _execute(self):
        """A task that handed its work back (its worker is stopping) goes back to its queue at once,
        as RQ requeues a job that returns Retry: no failure counted, no callback run."""
        result = super()._execute()
        if isinstance(result, dict) and result.get("status") == HANDED_BACK:
            if result.get("counted") is False and self.number_of_retries:
                self.number_of_retries -= 1  # RQ counts it back: not one of HAND_BACKS (a wait for the GPUs, a turn)
            return Retry(max=HAND_BACKS)
        return result

    @property
    def success_callback(self):
        return self._allowed_callback(self._success_callback_name, lambda: super(EyrieJob, self).success_callback)

    @property
    def failure_callback(self):
        return self._allowed_callback(self._failure_callback_name, lambda: super(EyrieJob, self).failure_callback)

    @property
    def stopped_callback(self):
        return self._allowed_callback(self._stopped_callback_name, lambda: super(EyrieJob, self).stopped_callback)

    @staticmethod
    def _allowed_callback(name, resolve):
        if name and name not in CALLBACKS:
            raise RefusedTask(f"callback {name!r} is not eyrie's; refused")
        return resolve()


def connect(redis_url: str, wait_s: float = 0.0) -> redis.Redis:
    """A checked connection: a clear error now (in seconds, not after the minute of patience a
    running worker gets) beats a stack trace at the first enqueue. `wait_s` (a worker starting:
    EYRIE_REDIS_WAIT_S): Redis not answering yet is waited for that long, with backoff, saying so
    on stderr, as a running worker rides out a Redis restart; then the same error."""
    deadline, pause = time.monotonic() + wait_s, 0.5
    while (error := _unreachable(redis_url)) is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            waited = f" (waited {wait_s:g} s: EYRIE_REDIS_WAIT_S)" if wait_s else ""
            raise EyrieError(f"cannot reach Redis at {safe_url(redis_url)}{waited}.",
                             "start redis-server or set EYRIE_REDIS_URL to a reachable Redis.")
        print(f"eyrie: Redis at {safe_url(redis_url)} does not answer ({error}); waiting up to {left:.0f} s "
              "more for it (EYRIE_REDIS_WAIT_S)", file=sys.stderr, flush=True)
        time.sleep(min(pause, left))
        pause = min(2 * pause, 10.0)
    return redis.Redis.from_url(redis_url, socket_connect_timeout=5, health_check_interval=30, retry=_Patient())


def _unreachable(redis_url: str) -> str | None:
    """Why Redis does not answer a ping now (None: it does); a wrong password is raised at once."""
    from redis.backoff import ConstantBackoff

    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=5, retry=RedisRetry(ConstantBackoff(0.5), 3)).ping()
    except redis.exceptions.AuthenticationError:
        raise EyrieError(f"Redis at {safe_url(redis_url)} rejected the password.",
                         "put the right password in EYRIE_REDIS_URL (redis://:PASSWORD@HOST:PORT/0).") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        return str(exc).strip() or type(exc).__name__
    return None


class _Patient(RedisRetry):
    """Every Redis command is retried through about a minute of Redis being away (a restart on
    its AOF): workers, their RQ bookkeeping and the tasks ride it out instead of crashing. Not in
    a process whose worker is stopping (SIGTERM): there a command fails at its first error, so that
    the stop ends within its bound whether Redis answers or not (eyrie.work.worker_loop.STOP_S)."""

    def __init__(self):
        from redis.backoff import ExponentialWithJitterBackoff

        super().__init__(ExponentialWithJitterBackoff(base=0.5, cap=10), retries=12)

    def call_with_retry(self, do, fail, is_retryable=None, **options):
        def retryable(error: Exception) -> bool:
            return not stop_requested() and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, retryable, **options)


def queue(conn: redis.Redis, name: str) -> Queue:
    """The queue of one stage. JSON payloads only: nothing read from Redis is unpickled."""
    return Queue(queue_name(name), connection=conn, serializer=JSONSerializer, job_class=EyrieJob)


def job_state(conn: redis.Redis, job_id: str) -> str | None:
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    except Exception:  # NoSuchJobError, or a payload that is not ours
        return None
    status = job.get_status(refresh=False)
    return status.value if status else None


def task_result(conn: redis.Redis, job_id: str) -> dict:
    """A finished task's result ({} when it has none, or is gone)."""
    try:
        return EyrieJob.fetch(job_id, connection=conn, serializer=JSONSerializer).return_value() or {}
    except Exception:  # NoSuchJobError, or a payload that is not ours
        return {}


def workers_on(conn: redis.Redis, name: str) -> int:
    return Worker.count(queue=queue(conn, name))


def job_errors(conn: redis.Redis, job_ids: list[str], limit: int = 5) -> list[str]:
    """The last line of the error of each failed task, most recent first."""
    errors = []
    for job_id in job_ids:
        if job_state(conn, job_id) == JobStatus.FAILED.value:
            result = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
            if result and result.exc_string:
                errors.append((result.created_at, f"{job_id}: {result.exc_string.strip().splitlines()[-1]}"))
    return [text for _, text in sorted(errors, reverse=True)[:limit]]


def enqueue_task(conn: redis.Redis, name: str, func: str, payload: dict, job_id: str,
                 timeout_s: int = 48 * 3600, at_front: bool = False) -> bool:
    """Enqueue one task unless a live one with the same id exists. True if enqueued now.

    A job that RQ still lists as started but whose lease is gone belonged to a dead worker:
    it is replaced, so a crash never strands a task until RQ's own cleanup notices. So is a job
    marked queued but in no queue: a chain that took it out to take its shard on died before
    marking it started (eyrie_generator.chain).
    """
    state = job_state(conn, job_id)
    if state in (JobStatus.SCHEDULED.value, JobStatus.DEFERRED.value):
        return False
    if state == JobStatus.QUEUED.value and _listed(conn, name, job_id):
        return False
    if state == JobStatus.STARTED.value and not _abandoned(conn, job_id):
        return False
    if state is not None:
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()
    _enqueue(conn, name, func, payload, job_id, timeout_s, at_front)
    return True


def enqueue(conn: redis.Redis, kind: TaskKind, payload: dict, shard: int = 0, timeout_s: int | None = None,
            at_front: bool = False) -> bool:
    """One task of a kind: its queue, function, task id and timeout (given, else its kind's);
    `at_front` for a planning task, so a queue full of long shards does not hold it back."""
    return enqueue_task(conn, kind.queue, kind.func, payload, kind.task_id(payload["run"], shard),
                        timeout_s=timeout_s or kind.timeout_s, at_front=at_front)


def _enqueue(conn, name: str, func: str, payload: dict, job_id: str, timeout_s: int, at_front: bool = False) -> None:
    queue(conn, name).enqueue(
        func, payload, job_id=job_id, job_timeout=timeout_s, result_ttl=7 * 86400, at_front=at_front,
        on_success=Callback(ON_TASK_DONE, timeout=ADVANCE_TIMEOUT_S),
        failure_ttl=30 * 86400, retry=Retry(max=len(RETRY_INTERVALS_S), interval=RETRY_INTERVALS_S),
        description=f"{name} {job_id}",
    )
    dispatch(conn, name, payload.get("run", ""))  # on Kubernetes, a GPU stage's Job for Kueue to admit


def _listed(conn: redis.Redis, name: str, job_id: str) -> bool:
    """In the queue, or in RQ's intermediate list: a worker is taking it off the queue now."""
    waiting = queue(conn, name)
    return any(conn.lpos(key, job_id) is not None for key in (waiting.key, waiting.intermediate_queue_key))


def _abandoned(conn: redis.Redis, job_id: str) -> bool:
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    started = job.started_at.replace(tzinfo=timezone.utc) if job.started_at else None
    old_enough = started is None or datetime.now(timezone.utc) - started > timedelta(seconds=LEASE_TTL_S)
    return old_enough and not conn.exists(keys.task_lease(job_id), keys.job_alive(job_id))


def task_counts(conn: redis.Redis, name: str) -> dict[str, int]:
    """A stage's tasks that still need a worker, by RQ state: queued (RQ's list), started (its
    started registry: RQ takes a running task off the list), scheduled (a retry's backoff; only a
    worker's scheduler requeues it) and deferred."""
    q = queue(conn, name)
    return {"queued": q.count, "started": q.started_job_registry.count,
            "scheduled": q.scheduled_job_registry.count, "deferred": q.deferred_job_registry.count}


def live_tasks(conn: redis.Redis, name: str) -> int:
    return sum(task_counts(conn, name).values())


def task_lease(conn: redis.Redis, task_id: str) -> Lock:
    """Who is working on a task now. Expires LEASE_TTL_S after its holder stops renewing it."""
    return Lock(conn, keys.task_lease(task_id), timeout=LEASE_TTL_S, blocking_timeout=LEASE_TTL_S + 5,
                thread_local=False)


@contextmanager
def held_task(conn: redis.Redis, task_id: str) -> Iterator[Lock | None]:
    """The task's lease for the block (waits for a dead holder's to lapse); None when a live
    worker holds it. Released at the end, unless it was already lost."""
    lease = task_lease(conn, task_id)
    if not lease.acquire(blocking=True):
        yield None
        return
    try:
        yield lease
    finally:
        try:
            lease.release()
        except redis.exceptions.LockError:
            pass


class Heartbeat(threading.Thread):
    """Renews a task lease, and the GPU lease once it is set, in the background: through the wait
    for the GPU, tokenizing, a slow model load and the work itself. `lost`: another worker took
    the task over. `hold(lease)`: renew another task's lease with it (a generate task's lanes
    taking on the next queued shard) until `drop(lease)`."""

    def __init__(self, task_lease: Lock, gpu=None, every_s: float = LEASE_TTL_S / 3):
        super().__init__(daemon=True, name="eyrie-heartbeat")
        self.task_lease, self.gpu, self.every_s = task_lease, gpu, every_s
        self.lost, self.done = False, threading.Event()
        self.held: set[Lock] = set()

    def hold(self, lease: Lock) -> None:
        self.held.add(lease)

    def drop(self, lease: Lock) -> None:
        self.held.discard(lease)

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                self.task_lease.extend(LEASE_TTL_S, replace_ttl=True)
                if self.gpu is not None and self.gpu.held():
                    self.gpu.renew()
            except redis.exceptions.LockError:
                self.lost = True
                return
            except redis.exceptions.ConnectionError:
                continue  # Redis away for a moment: the lease lasts LEASE_TTL_S
            self._renew_held()

    def _renew_held(self) -> None:
        for lease in list(self.held):
            try:
                lease.extend(LEASE_TTL_S, replace_ttl=True)
            except redis.exceptions.LockError:
                self.held.discard(lease)  # lapsed and taken over: that shard is its new holder's
            except redis.exceptions.ConnectionError:
                return

    def __enter__(self) -> "Heartbeat":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()


def reclaim_abandoned(conn: redis.Redis, name: str) -> int:
    """Requeue tasks RQ lists as started whose lease expired: their worker died."""
    registry = queue(conn, name).started_job_registry
    reclaimed = 0
    for entry in conn.zrange(registry.key, 0, -1):
        job_id = registry.parse_job_id(entry)  # entries are job_id:execution_id
        if job_state(conn, job_id) == JobStatus.STARTED.value and _abandoned(conn, job_id):
            job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
            func, payload, timeout = job.func_name, job.args[0], job.timeout
            conn.zrem(registry.key, entry)
            job.delete()
            _enqueue(conn, name, func, payload, job_id, timeout)
            reclaimed += 1
    return reclaimed
