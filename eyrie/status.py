"""A run's status, derived from its manifests in the store and live state in Redis."""

from __future__ import annotations

import time

from eyrie import gpu, inference, keys, progress
from eyrie.charts import chart_series
from eyrie.manifest import Counts, Layout, RunManifest, ShardManifest, load_run_manifest
from eyrie.pipeline import config_key
from eyrie.queue import job_errors, job_state, workers_on
from eyrie.stages import FETCH, PLAN_EXTRACT, TRAIN, task_id
from eyrie.status_models import ActiveTask, GpuHolder, PipelineStatus, RunStatus, StageStatus, TrainStatus

LIVE_JOB_STATES = {"queued", "started", "scheduled", "deferred"}


def run_status(conn, store, run: str) -> RunStatus:
    manifest = load_run_manifest(store, run)
    stages = {"generate": stage_status(conn, store, manifest, "generate",
                                       manifest.dataset.row_end - manifest.dataset.row_start)}
    if manifest.extract:
        stages["extract"] = stage_status(conn, store, manifest, "extract", manifest.extract.samples)
        stages["extract"].projected_bytes = manifest.extract.projected_bytes
    if manifest.train:
        stages["train"] = train_status(conn, store, manifest)
    cancelled = conn.get(keys.cancelled(run))
    if cancelled:
        _mark_cancelled(stages)
    lease = gpu.leases(conn)
    return RunStatus(run=run, created_at=manifest.created_at, target=manifest.target.model_dump(),
                     dataset=manifest.dataset.model_dump(), stages=stages, inference=inference.read(conn),
                     gpu_lease=GpuHolder(**lease) if lease else None, pipeline=pipeline_status(conn, store, run),
                     cancelled=cancelled.decode() if cancelled else None)


def overall_state(status: RunStatus) -> str:
    states = [s.state for s in status.stages.values()]
    if status.cancelled:
        return "cancelled"
    if "failed" in states or (status.pipeline and status.pipeline.blocked):
        return "failed"
    if all(s == "done" for s in states) and ("train" in status.stages or not status.pipeline):
        return "done"  # a pipeline is done once it is exported; a stage started by hand, once it is
    return "in_progress" if any(s != "pending" for s in states) else "pending"


def _mark_cancelled(stages: dict[str, StageStatus]) -> None:
    """A cancelled run's unfinished stages with no task still running read `cancelled`."""
    for s in stages.values():
        if s.state != "done" and not set(s.jobs) & LIVE_JOB_STATES:
            s.state = "cancelled"


def pipeline_status(conn, store, run: str) -> PipelineStatus | None:
    """Set for runs started by `eyrie run`: whether the chain is blocked, and the base drafter's fetch."""
    if not store.exists(config_key(run)):
        return None
    fetch, plan = FETCH.task_id(run), PLAN_EXTRACT.task_id(run)
    blocked = conn.get(keys.blocked(run))
    return PipelineStatus(blocked=blocked.decode() if blocked else None, fetch_state=job_state(conn, fetch),
                          fetch_errors=job_errors(conn, [fetch]), plan_extract_state=job_state(conn, plan),
                          plan_extract_errors=job_errors(conn, [plan]))


def stage_status(conn, store, manifest: RunManifest, stage: str, total: int) -> StageStatus:
    """One task per generate shard, in every stage; counts from finished shards' manifests
    (the record) plus live progress of the others."""
    layout, run = Layout(manifest.run), manifest.run
    live = progress.read(conn, run, stage)
    counts, done_shards, jobs, in_flight, waiting, active = Counts(), 0, {}, 0, set(), []
    skip_reasons: dict[str, int] = {}
    for plan in manifest.generate_shards:
        key = layout.shard_manifest(stage, plan.index)
        if store.exists(key):
            shard = ShardManifest.model_validate(store.get_json(key))
            stored = shard.counts.model_copy(update={"bytes": shard.counts.bytes or shard.bytes})  # generate: its JSONL
            counts, done_shards = counts.add(stored), done_shards + 1
            for reason, n in shard.skip_reasons.items():
                skip_reasons[reason] = skip_reasons.get(reason, 0) + n
            continue
        state = job_state(conn, task_id(stage, run, plan.index)) or "missing"
        jobs[state] = jobs.get(state, 0) + 1
        entry = live.get(str(plan.index))
        if entry:
            counts = counts.add(Counts(**{k: entry.get(k, 0) for k in Counts.model_fields if k != "total"}))
            if state == "started":
                active.append(_active(plan.index, entry))
                in_flight += entry.get("in_flight", 0)
                waiting.update([entry["waiting_for"]] if entry.get("waiting_for") else [])
    counts.total = total
    state = _state(done_shards, len(manifest.generate_shards), jobs, counts)
    return StageStatus(
        state=state, **counts.model_dump(), in_flight=in_flight, waiting_for=sorted(waiting),
        shards_total=len(manifest.generate_shards), shards_done=done_shards, jobs=jobs,
        workers=workers_on(conn, stage), active=active, skip_reasons=skip_reasons,
        errors=job_errors(conn, [task_id(stage, run, p.index) for p in manifest.generate_shards]),
        **_rates(conn, run, stage, counts, state))


def _active(shard: int, entry: dict) -> ActiveTask:
    elapsed = max(1e-6, entry.get("updated_at", 0) - entry.get("started", 0))
    return ActiveTask(shard=shard, worker=entry.get("worker"), done=entry.get("done", 0),
                      tokens=entry.get("tokens", 0), bytes=entry.get("bytes", 0),
                      tok_per_s=round(entry.get("tokens", 0) / elapsed, 1))


def _state(done: int, total: int, jobs: dict, counts: Counts) -> str:
    if done == total:
        return "done"
    if any(s in LIVE_JOB_STATES for s in jobs):
        return "in_progress"
    if jobs.get("failed"):
        return "failed"
    return "in_progress" if counts.done + counts.skipped + counts.failed else "pending"


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


def train_status(conn, store, manifest: RunManifest) -> TrainStatus:
    """The one training task: steps as its progress, the latest loss and per-TTT-step accuracy,
    checkpoints, τ per checkpoint once evaluated, the exported drafter, and the charts' series."""
    run, layout = manifest.run, Layout(manifest.run)
    live = progress.read(conn, run, "train").get("0", {})
    job = TRAIN.task_id(run)
    state = job_state(conn, job) or "missing"
    done = manifest.drafter is not None
    total, step = live.get("total_steps") or 0, live.get("step", 0)
    elapsed = max(1e-6, live.get("updated_at", 0) - live.get("started", 0))
    steps_this_attempt = step - live.get("resumed_at_step", 0)
    rate = steps_this_attempt / elapsed if steps_this_attempt > 0 else None
    evaluation, curve = (store.get_json(key) if store.exists(key) else None
                         for key in (layout.evaluation, layout.train_curve))
    return TrainStatus(
        state="done" if done else _state(0, 1, {state: 1}, Counts(done=step)),
        total=total, done=step, tokens=live.get("tokens", 0),
        tok_per_s=round(live.get("tokens", 0) / elapsed, 1) if live.get("tokens") else None,
        eta_s=0.0 if done else (round((total - step) / rate, 1) if rate and total else None),
        phase="done" if done else live.get("phase", "pending"), epoch=live.get("epoch"),
        epochs=manifest.train.epochs, loss=live.get("loss"), val_loss=live.get("val_loss"),
        acc=live.get("acc"), path=live.get("path"), notes=live.get("notes", []),
        checkpoints=live.get("checkpoints", []), evaluation=evaluation, drafter=manifest.drafter,
        verify=manifest.verify, charts=chart_series(evaluation, manifest.verify, curve),
        waiting_for=[live["waiting_for"]] if live.get("waiting_for") and live.get("phase") == "waiting" else [],
        workers=workers_on(conn, "train"), errors=job_errors(conn, [job]), jobs={state: 1},
        params=manifest.train.model_dump())
