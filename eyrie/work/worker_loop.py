"""The workers that run eyrie's tasks: RQ workers on one stage's queue that keep each task's alive
key fresh, requeue the tasks of dead workers, and stop cleanly on request (SIGTERM): the task
running hands its work back (eyrie.work.cancel.Stopping) and goes back to its queue at once
(eyrie.work.queue.EyrieJob), and the worker says what it handed back."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import redis
from rq import SimpleWorker, Worker
from rq.exceptions import StopRequested
from rq.job import JobStatus
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from eyrie.work import keys
from eyrie.work.cancel import STOP_REQUESTED, stop_requested  # tasks ask stop_requested() here
from eyrie.work.queue import LEASE_TTL_S, EyrieJob, job_state, queue, reclaim_abandoned
from eyrie.work.task_kinds import QUEUE_PREFIX, gpu_queues


def _keep_alive(conn: redis.Redis, job_id: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn.set(keys.job_alive(job_id), socket.gethostname(), ex=LEASE_TTL_S)
        except redis.exceptions.RedisError:
            pass  # Redis is away: the key lapses; the task's own lease decides who works on it
        stop.wait(LEASE_TTL_S / 3)


def worker_name(name: str) -> str:
    return f"{name}-{socket.gethostname()}-{os.getpid()}"


SCHEDULER_STOP_S = 10.0  # a stop waits this long for RQ's scheduler process, then kills it
STOP_S = 30.0  # a stop ends within this time of its task's end (idle: of the SIGTERM), Redis answering or not


def _end_within(seconds: float, worker) -> None:
    """The last resort of a stop: a worker still here `seconds` after it was free to go is waiting on
    a Redis that does not answer (a command on a connection Redis no longer serves waits for ever).
    It says so and exits (1), its work horse and RQ's scheduler with it; what it did not record
    (its leave, a task's state) Redis learns from their lapsed keys."""
    def end() -> None:
        time.sleep(seconds)
        worker.log.error("the stop did not end within %g s (Redis does not answer?): exiting without "
                         "recording it", seconds)
        scheduler = getattr(worker.scheduler, "_process", None)
        for pid in (worker.horse_pid, scheduler and scheduler.pid):
            if pid:  # 0 would be this whole process group
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=end, daemon=True, name="eyrie-stop-bound").start()


class _Maintained:
    """A worker that keeps its job's alive key fresh while it runs it (task code, callbacks and
    all), and whose maintenance requeues the tasks of dead workers: a survivor takes them over
    without a restart. `handed_back`: the tasks it gave back to their queue on a stop request."""

    _keeper: threading.Thread | None = None
    _dequeuing = False
    handed_back: tuple[str, ...] = ()

    def execute_job(self, job, queue):
        try:
            return super().execute_job(job, queue)
        finally:
            if self._keeper is not None:
                self._keeper_stop.set()
                self._keeper.join()
                self._keeper = None
            if self._stop_requested:
                _end_within(STOP_S, self)
            self.connection.delete(keys.job_alive(job.id))
            if self._stop_requested and job_state(self.connection, job.id) == JobStatus.QUEUED.value:
                self.handed_back = (*self.handed_back, job.id)

    def _start_keeper(self, job) -> None:
        self._keeper_stop = threading.Event()
        self._keeper = threading.Thread(target=_keep_alive, args=(self.connection, job.id, self._keeper_stop),
                                        daemon=True)
        self._keeper.start()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        self._dequeuing = True
        try:
            return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        finally:
            self._dequeuing = False

    def _shutdown(self):
        """A stop request (SIGTERM), in its signal handler. RQ raises StopRequested wherever an idle
        worker is then, and in a log line or its teardown that ends in a traceback (`eyrie: internal
        error`): raised only to end its wait for a task; anywhere else its loop sees the request at
        its next turn. No Redis command here (RQ records the request's date): one waiting on an away
        Redis would hold up the stop, or the task this handler interrupted."""
        busy = self.get_state() == WorkerStatus.BUSY
        self._stop_requested = True
        if not busy:  # busy: the bound starts as the task ends (execute_job)
            _end_within(STOP_S, self)
        if self.scheduler:
            self.stop_scheduler()
        if self._dequeuing and not busy:
            raise StopRequested()

    def handle_warm_shutdown_request(self):
        """SIGTERM (or Ctrl+C): RQ waits for the task in hand to end; the task sees `stop_requested()`
        and hands its work back (a work horse forked a moment ago still has this handler: it is
        set there too)."""
        super().handle_warm_shutdown_request()
        STOP_REQUESTED.set()

    def stop_scheduler(self):
        """RQ's own stop joins its scheduler process without a bound. That process is forked from the
        worker, and forked from a worker busy with threads (a training's) it can deadlock in the child
        at once: a burst train worker then hung 20 min after its task had finished (CI, test_train_e2e).
        SIGTERM, SCHEDULER_STOP_S to end, then SIGKILL: a stop ends within a stated bound."""
        process = self.scheduler._process if self.scheduler else None
        if process is None or not process.pid:
            return
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGTERM)
        process.join(SCHEDULER_STOP_S)
        if process.is_alive():
            self.log.warning("RQ's scheduler process %s did not stop in %g s: killed", process.pid, SCHEDULER_STOP_S)
            process.kill()
            process.join(SCHEDULER_STOP_S)

    def run_maintenance_tasks(self):
        super().run_maintenance_tasks()
        for q in self.queues:
            reclaimed = reclaim_abandoned(self.connection, q.name.removeprefix(QUEUE_PREFIX))
            if reclaimed:
                self.log.warning("requeued %d task(s) of dead workers on %s", reclaimed, q.name)


class ForkingWorker(_Maintained, Worker):
    def fork_work_horse(self, job, queue):
        """The keeper starts after the fork, in this process (the work horse never returns here): a
        thread inside getaddrinfo while the process forks leaves the work horse glibc's resolver lock
        held for good, and its first Redis connection hangs with the task taken and nothing done."""
        super().fork_work_horse(job, queue)
        self._start_keeper(job)

    def setup_work_horse_signals(self):
        """In the work horse: Ctrl+C is the worker's to handle; SIGTERM asks the task to hand its
        work back (RQ's default would kill it, leaving the shard to wait for its lease to lapse)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: STOP_REQUESTED.set())

    def handle_warm_shutdown_request(self):
        """SIGTERM to the worker (its work horse is in a process group of its own): passed on to the
        work horse, whose task hands its shard back within seconds; then the worker stops."""
        super().handle_warm_shutdown_request()
        if self.horse_pid:
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                os.kill(self.horse_pid, signal.SIGTERM)


class InProcessWorker(_Maintained, SimpleWorker):
    def execute_job(self, job, queue):
        self._start_keeper(job)
        return super().execute_job(job, queue)


def run_worker(conn: redis.Redis, name: str, burst: bool) -> None:
    """An RQ worker on one stage's queue; the scheduler runs retries after their backoff.

    RQ itself fails or retries a dead worker's job once its heartbeat lapses (for tasks run in
    the worker process: the job's whole timeout); the shorter task lease lets a live worker
    take it over within a minute."""
    reclaim_abandoned(conn, name)
    # GPU stages run tasks in the worker process itself: the model stays loaded between tasks
    # (and CUDA does not survive a fork). The generator forks a work horse per task.
    worker_class = InProcessWorker if name in gpu_queues() else ForkingWorker
    worker = worker_class([queue(conn, name)], connection=conn, serializer=JSONSerializer,
                          job_class=EyrieJob, name=worker_name(name), maintenance_interval=2 * LEASE_TTL_S,
                          worker_ttl=3 * LEASE_TTL_S)
    signals, stopped, unrecorded = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}, False, None
    try:
        worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    except StopRequested:  # RQ raises it where a stop request finds the worker idle (quitting, say)
        stopped = True  # a stop, not an error
    except redis.exceptions.RedisError as exc:  # a stop's bookkeeping (RQ's teardown) with Redis away
        if not stop_requested():
            raise
        unrecorded = exc
    finally:  # a worker stopping may be restarting: eyrie.stages.verify waits for a verifier that just left
        for sig, handler in signals.items():  # RQ's handlers would raise StopRequested in the caller
            signal.signal(sig, handler)
        unrecorded = _record_leave(conn, name) or unrecorded
    if stopped or worker._stop_requested:
        handed = worker.handed_back
        print(f"eyrie worker {name}: stopped on request; " + (
            f"handed back {', '.join(handed)} (queued again; what was done is stored)" if handed
            else "nothing handed back (no task was running, or it finished first)") + (
            f"; Redis did not answer ({unrecorded}): what it did not record, its lapsed keys tell" if unrecorded
            else ""), flush=True)


def _record_leave(conn: redis.Redis, name: str) -> Exception | None:
    """When this worker left (verify waits for a verifier that just left); on a stop with Redis away,
    not recorded: the error, returned."""
    try:
        conn.set(keys.worker_left(name), time.time())
    except redis.exceptions.RedisError as exc:
        if not stop_requested():
            raise
        return exc
    return None
