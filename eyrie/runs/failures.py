"""A run's failures by reason, per stage: samples failed or skipped (from the finished shards'
manifests, one example each), samples training left out (eyrie.stages.train.left_out, as status
counts them), and failed tasks (their last error line). What the dashboard and `eyrie logs` show."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import orjson
from pydantic import BaseModel

from eyrie.data.manifest import ShardManifest, outcomes
from eyrie.runs.pipeline import run_view
from eyrie.stages import PIPELINE, RunView
from eyrie.stages.sharded import ShardedStage
from eyrie.stages.train import Train, left_out
from eyrie.work import progress
from eyrie.work.queue import job_errors


_EXAMPLES: dict[tuple, dict] = {}  # generate shards' examples where their manifests have none


class Reason(BaseModel):
    stage: str
    kind: Literal["failed", "skipped", "dropped", "task"]
    reason: str
    count: int
    example: dict | None = None  # a sample {sample_id, row, detail}, or a task {task}


def failures(conn, store, run: str) -> list[Reason]:
    """Most frequent first within each stage, stages in pipeline order."""
    view = run_view(conn, store, run)
    found: list[Reason] = []
    for stage in PIPELINE:
        reasons = _samples(view, stage) if isinstance(stage, ShardedStage) else []
        reasons += _dropped(view, stage) if isinstance(stage, Train) else []
        reasons += _tasks(view, stage)
        found += sorted(reasons, key=lambda r: (r.kind == "task", -r.count))
    return found


def _samples(view: RunView, stage: ShardedStage) -> list[Reason]:
    counts: dict[tuple[str, str], int] = Counter()
    examples: dict[tuple[str, str], dict] = {}
    for index in stage.shards(view):
        key = view.layout.shard_manifest(stage.name, index)
        if not view.store.exists(key):
            continue
        shard = ShardManifest.model_validate(view.store.get_json(key))
        counts.update({("skipped", k): n for k, n in shard.skip_reasons.items()})
        counts.update({("failed", k): n for k, n in shard.failure_errors.items()})
        if (shard.skip_reasons or shard.failure_errors) and not shard.examples:  # written before examples were
            shard.examples = _examples_of(view.store, shard)
        for kind, by_key in shard.examples.items():
            for reason, example in by_key.items():
                examples.setdefault((kind, reason), example)
    return [Reason(stage=stage.name, kind=kind, reason=reason or "(no message)", count=n,
                   example=examples.get((kind, reason))) for (kind, reason), n in counts.items()]


def _examples_of(store, shard: ShardManifest) -> dict:
    """From its records: extract's not_done, or generate's stored answers (read once per process:
    a stored shard, known by its checksum, never changes)."""
    if shard.not_done or not shard.object:
        return outcomes(shard.not_done)["examples"]
    key = (shard.object, shard.sha256)
    if key not in _EXAMPLES:
        if len(_EXAMPLES) > 4096:
            _EXAMPLES.clear()
        records = [orjson.loads(line) for line in store.get_bytes(shard.object).splitlines() if line.strip()]
        _EXAMPLES[key] = outcomes(records)["examples"]
    return _EXAMPLES[key]


def _dropped(view: RunView, stage: Train) -> list[Reason]:
    live = progress.read(view.conn, view.run, stage.name).get("0", {})
    return [Reason(stage=stage.name, kind="dropped", reason=d.reason, count=d.count,
                   example=d.example) for d in left_out(view, live)]


def _tasks(view: RunView, stage) -> list[Reason]:
    """Failed tasks grouped by their error's last line."""
    by_error: dict[str, list[str]] = {}
    for line in job_errors(view.conn, stage.task_ids(view), limit=1000):
        task, _, error = line.partition(": ")
        by_error.setdefault(error, []).append(task)
    return [Reason(stage=stage.name, kind="task", reason=error, count=len(tasks), example={"task": tasks[0]})
            for error, tasks in by_error.items()]
