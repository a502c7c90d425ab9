"""The workers up now, as RQ registers them: what each runs and when it last beat."""

from __future__ import annotations

import time

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from eyrie.work import keys
from eyrie.work.queue import LEASE_TTL_S
from eyrie.work.task_kinds import QUEUE_PREFIX


def workers_now(conn: redis.Redis) -> list[dict]:
    """Every worker on an eyrie queue: name, host, pid, queues, state (busy/idle/...), the task
    it runs (None when idle), its last heartbeat (epoch seconds) and how long ago that was."""
    found = []
    for worker in Worker.all(connection=conn, serializer=JSONSerializer):
        queues = [q.name.removeprefix(QUEUE_PREFIX) for q in worker.queues if q.name.startswith(QUEUE_PREFIX)]
        if not queues:
            continue
        beat = worker.last_heartbeat.timestamp() if worker.last_heartbeat else None
        state, task = worker.get_state(), worker.get_current_job_id()
        beat = max(filter(None, (beat, task and lease_renewed_at(conn, task))), default=None)
        found.append({"worker": worker.name, "host": worker.hostname, "pid": worker.pid, "queues": queues,
                      "state": getattr(state, "value", state), "task": task,
                      "last_heartbeat": beat, "heartbeat_age_s": round(time.time() - beat, 1) if beat else None})
    return sorted(found, key=lambda w: (w["task"] is None, w["worker"]))


def lease_renewed_at(conn: redis.Redis, task: str) -> float | None:
    """When the task's lease was last renewed (eyrie's heartbeat thread, every few seconds through a
    task of hours; RQ's own worker heartbeat is not renewed while its task runs in the worker's
    process), from its time to live; None where no lease is held."""
    ttl_ms = conn.pttl(keys.task_lease(task))
    return time.time() - (LEASE_TTL_S - ttl_ms / 1000) if ttl_ms > 0 else None
