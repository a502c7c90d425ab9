"""A run's status, derived from its manifests in the store and live state in Redis: each stage of
the pipeline (eyrie.stages.PIPELINE) reports its own."""

from __future__ import annotations

from eyrie.data.manifest import load_run_manifest
from eyrie.runs import serve_turns
from eyrie.runs.pipeline import run_view
from eyrie.stages import PIPELINE, RunView, run_stages
from eyrie.stages.base import LIVE_JOB_STATES
from eyrie.work import gpu, inference, keys
from eyrie.work.status_models import GpuHolder, PipelineStatus, RunStatus, StageStatus


def run_status(conn, store, run: str) -> RunStatus:
    """Raises UnknownRun for a run with no manifest, no pipeline config and no planning task."""
    view = run_view(conn, store, run)
    stages = {s.name: status for s in PIPELINE if (status := s.status(view)) is not None}
    manifest, config = view.manifest, view.config
    if manifest is None and config is None and not stages:
        load_run_manifest(store, run)  # its UnknownRun: the message names the fix
    cancelled = conn.get(keys.cancelled(run))
    if cancelled:
        _mark_cancelled(stages)
    else:
        _waiting_turn(view, stages)
    lease = gpu.leases(conn)
    planned = manifest is not None  # else being planned: what its config (if any) asks for
    return RunStatus(run=run, created_at=manifest.created_at if planned else None,
                     target=manifest.target.model_dump() if planned else config.target.model_dump() if config else {},
                     dataset=manifest.dataset.model_dump() if planned else config.dataset.model_dump() if config else {},
                     stages=stages, inference=inference.read(conn),
                     gpu_lease=GpuHolder(**lease) if lease else None, pipeline=pipeline_status(view),
                     cancelled=cancelled.decode() if cancelled else None)


def overall_state(status: RunStatus) -> str:
    states = [s.state for s in status.stages.values()]
    if status.cancelled:
        return "cancelled"
    if "failed" in states or (status.pipeline and status.pipeline.blocked):
        return "failed"
    # a run is done once every stage of it with a status of its own is (a pipeline: exported and verified)
    every_stage = {s.name for s in PIPELINE if s.shown and (not status.pipeline or s.name in status.pipeline.stages)}
    if all(s == "done" for s in states) and (not status.pipeline or every_stage <= set(status.stages)):
        return "done"
    return "in_progress" if any(s != "pending" for s in states) else "pending"


def _waiting_turn(view: RunView, stages: dict[str, StageStatus]) -> None:
    """A run whose generation waits its turn at the stack's inference server says for which run's
    (eyrie.runs.serve_turns), whether a task of it is waiting in a worker or handed back to its queue."""
    generate = stages.get(PIPELINE[0].name)
    if view.manifest is None or generate is None or generate.state in ("done", "failed"):
        return
    held_by = serve_turns.holder(view.conn, view.store, view.run, view.manifest.target)
    if held_by is not None:
        generate.waiting_for = sorted({*generate.waiting_for, serve_turns.turn_text(held_by)})


def _mark_cancelled(stages: dict[str, StageStatus]) -> None:
    """A cancelled run's unfinished stages with no task still running read `cancelled`."""
    for s in stages.values():
        if s.state != "done" and not set(s.jobs) & LIVE_JOB_STATES:
            s.state = "cancelled"


def pipeline_status(view: RunView) -> PipelineStatus | None:
    """Set for runs with a config kept (every run started since stages alone keep one): its stages,
    whether the chain is blocked, and the state of the stages' planners and side tasks (the extract
    stage's planning, the base drafter's fetch)."""
    if view.config is None:
        return None
    blocked = view.conn.get(keys.blocked(view.run))
    tasks = {name: state for s in PIPELINE for name, state in s.planner_states(view).items()}
    return PipelineStatus(stages=[s.name for s in run_stages(view.config)], blocked=blocked.decode() if blocked else None,
                          tasks=tasks)
