"""The control side of a stage with one task per generate shard (generate, extract): done once
every shard's manifest is stored; its status is the shard manifests' counts plus live progress."""

from __future__ import annotations

import time

from eyrie.data.manifest import Counts, ShardManifest
from eyrie.stages.base import PipelineStage, RunView, state_of
from eyrie.work import progress
from eyrie.work.queue import enqueue, job_errors, job_state, workers_on
from eyrie.work.status_models import ActiveTask, StageStatus


class ShardedStage(PipelineStage):
    def total(self, view: RunView) -> int:
        """The items the stage accounts for (rows, samples)."""
        raise NotImplementedError

    def shards(self, view: RunView) -> list[int]:
        return [p.index for p in view.manifest.generate_shards] if view.manifest else []

    def shard_done(self, view: RunView, shard: int) -> bool:
        return view.store.exists(view.layout.shard_manifest(self.name, shard))

    def done(self, view: RunView) -> bool:
        return self.planned(view) and all(self.shard_done(view, i) for i in self.shards(view))

    def enqueue_work(self, view: RunView) -> bool:
        for shard in self.shards(view):
            if not self.shard_done(view, shard):
                enqueue(view.conn, self.work, {"run": view.run, "shard": shard}, shard)
        return True

    def tasks_left(self, view: RunView) -> list[str]:
        return [self.work.task_id(view.run, i) for i in self.shards(view) if not self.shard_done(view, i)]

    def task_ids(self, view: RunView) -> list[str]:
        shards = [self.work.task_id(view.run, i) for i in self.shards(view)]
        return shards + [k.task_id(view.run) for k in self.task_kinds() if k is not self.work]

    def status(self, view: RunView) -> StageStatus | None:
        return sharded_status(view, self, self.total(view)) if self.planned(view) else self.refused(view)


def sharded_status(view: RunView, stage: ShardedStage, total: int) -> StageStatus:
    """One task per generate shard: counts from finished shards' manifests (the record) plus the
    live progress of the others."""
    conn, store, run = view.conn, view.store, view.run
    live = progress.read(conn, run, stage.name)
    counts, done_shards, jobs, in_flight, waiting, active = Counts(), 0, {}, 0, set(), []
    skip_reasons: dict[str, int] = {}
    for index in stage.shards(view):
        key = view.layout.shard_manifest(stage.name, index)
        if store.exists(key):
            shard = ShardManifest.model_validate(store.get_json(key))
            stored = shard.counts.model_copy(update={"bytes": shard.counts.bytes or shard.bytes})  # generate: its JSONL
            counts, done_shards = counts.add(stored), done_shards + 1
            for reason, n in shard.skip_reasons.items():
                skip_reasons[reason] = skip_reasons.get(reason, 0) + n
            continue
        state = job_state(conn, stage.work.task_id(run, index)) or "missing"
        jobs[state] = jobs.get(state, 0) + 1
        entry = live.get(str(index))
        if entry:
            counts = counts.add(Counts(**{k: entry.get(k, 0) for k in Counts.model_fields if k != "total"}))
            if state == "started":
                active.append(_active(index, entry))
                in_flight += entry.get("in_flight", 0)
                waiting.update([entry["waiting_for"]] if entry.get("waiting_for") else [])
    counts.total = total
    shards = stage.shards(view)
    state = state_of(done_shards, len(shards), jobs, counts.done + counts.skipped + counts.failed)
    return StageStatus(
        state=state, **counts.model_dump(), in_flight=in_flight, waiting_for=sorted(waiting),
        shards_total=len(shards), shards_done=done_shards, jobs=jobs,
        workers=workers_on(conn, stage.queue), active=active, skip_reasons=skip_reasons,
        errors=job_errors(conn, [stage.work.task_id(run, i) for i in shards]),
        **_rates(conn, run, stage.name, counts, state))


def _active(shard: int, entry: dict) -> ActiveTask:
    elapsed = max(1e-6, entry.get("updated_at", 0) - entry.get("started", 0))
    return ActiveTask(shard=shard, worker=entry.get("worker"), done=entry.get("done", 0),
                      tokens=entry.get("tokens", 0), bytes=entry.get("bytes", 0),
                      tok_per_s=round(entry.get("tokens", 0) / elapsed, 1))


def _rates(conn, run: str, stage: str, counts: Counts, state: str) -> dict:
    started = progress.started_at(conn, run, stage)
    processed = counts.done + counts.skipped + counts.failed
    if not started or not processed:
        return {"tok_per_s": None, "samples_per_s": None, "eta_s": None}
    updated = max((e.get("updated_at", 0) for e in progress.read(conn, run, stage).values()),
                  default=time.time())
    elapsed = max(1e-6, (updated if state == "done" else time.time()) - started)
    rate = processed / elapsed
    return {"tok_per_s": round(counts.tokens / elapsed, 1), "samples_per_s": round(rate, 3),
            "eta_s": 0.0 if state == "done" else round(max(0, counts.total - processed) / rate, 1)}
