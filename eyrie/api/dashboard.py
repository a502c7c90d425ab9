"""What the dashboard reads besides a run's status and its failures (eyrie.runs.failures): what
runs now (the workers' heartbeats) and tokens per second per stage over time."""

from __future__ import annotations

from eyrie.runs.pipeline import run_view
from eyrie.stages import PIPELINE
from eyrie.work import progress
from eyrie.work.workers import workers_now


def running_now(conn, store, run: str) -> dict:
    """`tasks`: the workers running one of the run's tasks now (worker, host, last heartbeat, task);
    `workers`: every worker up, with its queues and state."""
    view = run_view(conn, store, run)  # its planning task's id too, before it has a manifest
    ids = {job for stage in PIPELINE for job in stage.task_ids(view)}
    workers = workers_now(conn)
    return {"tasks": [w for w in workers if w["task"] in ids], "workers": workers}


def token_rates(conn, run: str) -> dict[str, list[tuple[float, float]]]:
    """Per stage that reported progress: [(time, tokens/s)]."""
    return {s.name: series for s in PIPELINE if (series := progress.token_rates(conn, run, s.name))}
