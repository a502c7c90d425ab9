"""Waiting for a stage's planning task, as `eyrie run` and `eyrie generate` do: a worker of its
queue runs it when one takes it within PICKUP_S; otherwise (none up, or all busy with long
shards) this process runs that one task as an in-process worker of the queue, taken off the queue
first, so the user's command still answers at once. The task lease makes it run once either way."""

from __future__ import annotations

import logging
import time

from rq.serializers import JSONSerializer

from eyrie.core.errors import EyrieError
from eyrie.work.queue import EyrieJob, InProcessWorker, job_errors, job_state, queue, task_result, workers_on
from eyrie.work.task_kinds import TaskKind

PICKUP_S = 10.0
ENDED = {"finished", "failed", "canceled", "stopped", "scheduled", None}  # scheduled: failed once, retried later


def await_planning(conn, kind: TaskKind, run: str, pickup_s: float = PICKUP_S, poll_s: float = 0.2) -> dict:
    """The planning task's result; its refusal or failure raised as one EyrieError."""
    task, deadline = kind.task_id(run), time.monotonic() + (pickup_s if workers_on(conn, kind.queue) else 0)
    while (state := job_state(conn, task)) not in ENDED:
        if state == "queued" and time.monotonic() >= deadline and queue(conn, kind.queue).remove(task):
            _run_here(conn, kind, task)
            continue
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
