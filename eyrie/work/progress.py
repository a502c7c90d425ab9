"""Live per-task progress in Redis: workers write it, status reads it. The store stays the record."""

from __future__ import annotations

import time

import orjson
import redis

from eyrie.work import keys


def report(conn: redis.Redis, run: str, stage: str, task: str, started: float, **fields) -> None:
    """`started`: when this attempt at the task began (for its own rate)."""
    fields["updated_at"], fields["started"] = time.time(), started
    with conn.pipeline() as pipe:
        pipe.hset(keys.progress(run, stage), task, orjson.dumps(fields))
        pipe.hsetnx(keys.stage_started(run, stage), "started_at", time.time())
        pipe.execute()


def reset(conn: redis.Redis, run: str, stage: str) -> None:
    """A new plan for a stage starts with no live progress (a run name may be reused)."""
    conn.delete(keys.progress(run, stage), keys.stage_started(run, stage))


def read(conn: redis.Redis, run: str, stage: str) -> dict[str, dict]:
    return {k.decode(): orjson.loads(v) for k, v in conn.hgetall(keys.progress(run, stage)).items()}


def started_at(conn: redis.Redis, run: str, stage: str) -> float | None:
    value = conn.hget(keys.stage_started(run, stage), "started_at")
    return float(value) if value else None
