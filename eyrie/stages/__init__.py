"""The pipeline: an ordered list of declared stages (eyrie.stages.base.PipelineStage). Everything
that knows the stages (`advance`, cancel, retry, status, `--plan`, the workers' queues, the
queues' allow-list, the API, the Kubernetes Jobs) loops over PIPELINE; adding a stage is a class
and one line here (docs/architecture.md)."""

from __future__ import annotations

import importlib

from eyrie.core.errors import EyrieError
from eyrie.stages.base import PipelineStage, RunView
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train
from eyrie.stages.verify import Verify
from eyrie.work.task_kinds import (CALLBACKS, ON_TASK_DONE, QUEUE_PREFIX, TaskKind, entry, queue_name, task_funcs,
                                   task_id)

PIPELINE: list[PipelineStage] = [Generate(), Extract(), Train(), Verify()]

# the task kinds the services import by name
GENERATE, PLAN_GENERATE, EXTRACT, PLAN_EXTRACT = Generate.work, Generate.planner, Extract.work, Extract.planner
TRAIN, PLAN_TRAIN, VERIFY = Train.work, Train.planner, Verify.work
FETCH = Train.side_tasks[0]

__all__ = ["PIPELINE", "PipelineStage", "RunView", "TaskKind", "CALLBACKS", "ON_TASK_DONE", "QUEUE_PREFIX",
           "entry", "queue_name", "task_id", "stage", "queues", "gpu_queues", "task_kinds", "task_funcs",
           "startable", "run_stages", "check_stage_names", "on_queue", "on_queue_stages", "preload", "GENERATE", "PLAN_GENERATE", "EXTRACT",
           "PLAN_EXTRACT", "TRAIN", "PLAN_TRAIN", "VERIFY", "FETCH"]


def stage(name: str) -> PipelineStage:
    for s in PIPELINE:
        if s.name == name:
            return s
    raise KeyError(name)


def task_kinds() -> dict[str, TaskKind]:
    return {kind.name: kind for s in PIPELINE for kind in s.task_kinds()}


def queues() -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.queue for s in PIPELINE))


def gpu_queues() -> tuple[str, ...]:
    return tuple(q for q in queues() if any(k.gpu for k in task_kinds().values() if k.queue == q))


def startable() -> tuple[str, ...]:
    """The stages a user may start on their own."""
    return tuple(s.name for s in PIPELINE if s.starts_alone)


def run_stages(config) -> list[PipelineStage]:
    """The stages a run runs, in pipeline order: those its config names (a stage started alone: that
    one), else every stage; none for a run with no config kept."""
    if config is None:
        return []
    return [s for s in PIPELINE if config.stages is None or s.name in config.stages]


def check_stage_names(config) -> None:
    """A run config's `stages` are stages of the pipeline."""
    unknown = sorted(set(config.stages or ()) - {s.name for s in PIPELINE})
    if unknown:
        raise EyrieError(f"run {config.run}: no stage {', '.join(map(repr, unknown))} in the pipeline.",
                         f"name stages of: {', '.join(s.name for s in PIPELINE)} (or leave `stages` out: all).")


def on_queue_stages(queue: str) -> list[PipelineStage]:
    return [s for s in PIPELINE if s.queue == queue]


def on_queue(queue: str) -> list[TaskKind]:
    return [k for k in task_kinds().values() if k.queue == queue]


def preload(queue: str) -> None:
    """A worker imports its task kinds' modules once at its start, not in every task."""
    for kind in on_queue(queue):
        importlib.import_module(kind.func.rpartition(".")[0])
