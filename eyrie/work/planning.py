"""Waiting for a stage's planning task, as `eyrie run` and `eyrie generate|extract|train` do: a
worker of its queue runs it when one takes it within PICKUP_S; otherwise (none up, or all busy
with long shards) this process runs that one task as an in-process worker of the queue, taken off
the queue first, so the user's command still answers at once. The task lease makes it run once
either way."""

from __future__ import annotations

import logging
import time

from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.work.queue import EyrieJob, job_errors, job_state, queue, task_result, workers_on
from eyrie.work.task_kinds import TaskKind
from eyrie.work.worker_loop import InProcessWorker

PICKUP_S = 10.0
ENDED = {"finished", "failed", "canceled", "stopped", "scheduled", None}  # scheduled: failed once, retried later


def await_planning(conn, kind: TaskKind, run: str, pickup_s: float = PICKUP_S, poll_s: float = 0.2,
                   wait_s: float | None = None) -> dict:
    """The planning task's result; its refusal or failure raised as one EyrieError; so is a task a
    worker took and has not finished after `wait_s` (EYRIE_PLAN_WAIT_S): that worker may hang."""
    task, deadline = kind.task_id(run), time.monotonic() + (pickup_s if workers_on(conn, kind.queue) else 0)
    wait_s = load_settings().plan_wait_s if wait_s is None else wait_s
    taken = None
    while (state := job_state(conn, task)) not in ENDED:
        if state == "queued" and time.monotonic() >= deadline and queue(conn, kind.queue).remove(task):
            _run_here(conn, kind, task)
            continue
        taken = (taken or time.monotonic()) if state == "started" else None
        if taken is not None and time.monotonic() - taken > wait_s:
            raise _still_running(conn, task, run, wait_s)
        time.sleep(poll_s)
    if state == "finished":
        result = task_result(conn, task)
        if result.get("status") == "refused":
            raise EyrieError(result["error"], result.get("fix", ""))
        return result
    errors = job_errors(conn, [task], limit=1) or [f"{task}: {state or 'gone'}"]
    if state == "scheduled":  # failed once; RQ runs it again after its backoff, as a worker takes it
        raise EyrieError(f"planning the run failed once and is retried after a pause: {errors[0]}.",
                         f"`eyrie status {run}` shows when it is planned; fix what it names if it fails again.")
    raise EyrieError(f"planning the run did not finish: {errors[0]}.",
                     f"fix what it names, then start it again; `eyrie logs {run}` shows its errors.")


def _still_running(conn, task: str, run: str, wait_s: float) -> EyrieError:
    job = EyrieJob.fetch(task, connection=conn, serializer=JSONSerializer)
    worker = f"worker {job.worker_name}" if job.worker_name else "a worker"
    return EyrieError(f"planning run {run} ({task}) has not finished after {wait_s:g} s on {worker}: it may hang "
                      "(nothing here was stopped; the task goes on if it can).",
                      f"read that worker's log and restart it if it hangs (its task is taken over), then start the "
                      f"run again; `eyrie status {run}` shows where it is. A plan that takes longer (a large dataset "
                      "read, a base drafter's download) needs a larger EYRIE_PLAN_WAIT_S.")


def _run_here(conn, kind: TaskKind, task: str) -> None:
    """The one task, as a worker of its queue would run it (its state, result and callback in RQ);
    its log lines are a worker's: here the caller prints its result."""
    q = queue(conn, kind.queue)
    job = EyrieJob.fetch(task, connection=conn, serializer=JSONSerializer)
    worker = InProcessWorker([q], connection=conn, serializer=JSONSerializer, job_class=EyrieJob)
    worker.register_birth()
    logging.disable(logging.WARNING)
    try:
        worker.execute_job(job, q)
    finally:
        logging.disable(logging.NOTSET)
        worker.register_death()
