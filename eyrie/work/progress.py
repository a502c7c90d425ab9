"""Live per-task progress in Redis: workers write it, status reads it. The store stays the record."""

from __future__ import annotations

import math
import time

import orjson
import redis

from eyrie.work import keys

# The rate history keeps each task's last report per interval: 1 s at its start, widening to
# 1/RATE_SAMPLES of its time so far (a task of days keeps a few thousand).
RATE_SAMPLES = 200


def report(conn: redis.Redis, run: str, stage: str, task: str, started: float, **fields) -> None:
    """`started`: when this attempt at the task began (for its own rate)."""
    now = time.time()
    fields["updated_at"], fields["started"] = now, started
    with conn.pipeline() as pipe:
        pipe.hset(keys.progress(run, stage), task, orjson.dumps(fields))
        width = max(1, int((now - started) // RATE_SAMPLES))
        pipe.hset(keys.rates(run, stage), f"{task}:{width}:{int(now // width)}",
                  orjson.dumps([now, fields.get("tokens", 0), started]))
        pipe.hsetnx(keys.stage_started(run, stage), "started_at", time.time())
        pipe.execute()


def reset(conn: redis.Redis, run: str, stage: str) -> None:
    """A new plan for a stage starts with no live progress (a run name may be reused)."""
    conn.delete(keys.progress(run, stage), keys.stage_started(run, stage), keys.rates(run, stage),
                keys.curve(run, stage))


def read(conn: redis.Redis, run: str, stage: str) -> dict[str, dict]:
    return {k.decode(): orjson.loads(v) for k, v in conn.hgetall(keys.progress(run, stage)).items()}


def report_curve(conn: redis.Redis, run: str, stage: str, curve: dict) -> None:
    """The stage's curve to the step just done (eyrie.data.charts.Curve's snapshot): what the charts
    draw while it runs; its store copy is written only with each checkpoint."""
    conn.set(keys.curve(run, stage), orjson.dumps(curve))


def read_curve(conn: redis.Redis, run: str, stage: str) -> dict | None:
    value = conn.get(keys.curve(run, stage))
    return orjson.loads(value) if value else None


def started_at(conn: redis.Redis, run: str, stage: str) -> float | None:
    value = conn.hget(keys.stage_started(run, stage), "started_at")
    return float(value) if value else None


def token_rates(conn: redis.Redis, run: str, stage: str, points: int = 120) -> list[tuple[float, float]]:
    """The stage's tokens per second over time, from its tasks' reports: [(end of interval, tok/s)],
    at most `points` intervals. The tokens between two reports of a task are spread evenly over the
    time between them; each attempt at a task counts from zero at its start."""
    attempts: dict[tuple, list] = {}
    for field, value in conn.hgetall(keys.rates(run, stage)).items():
        t, tokens, started = orjson.loads(value)
        attempts.setdefault((field.decode().rsplit(":", 2)[0], started), [(started, 0)]).append((t, tokens))
    segments = []  # (from, to, tokens made in between)
    for reports in attempts.values():
        reports.sort()
        segments += [(a, b, max(0, tb - ta)) for (a, ta), (b, tb) in zip(reports, reports[1:])]
    if not segments:
        return []
    start, end = min(a for a, _, _ in segments), max(b for _, b, _ in segments)
    width = max(1.0, (end - start) / points)
    made = [0.0] * max(1, math.ceil((end - start) / width))
    for a, b, tokens in segments:
        first, last = int((a - start) // width), min(len(made) - 1, int((b - start) // width))
        for i in range(first, last + 1):  # each interval gets the share of [a, b] it overlaps
            lo, hi = max(a, start + i * width), min(b, start + (i + 1) * width)
            made[i] += tokens * ((hi - lo) / (b - a) if b > a else 1.0)
    return [(start + (i + 1) * width, value / width) for i, value in enumerate(made)]
