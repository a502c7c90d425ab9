"""A pipeline stage, declared: its name, queue, settings sections, task kinds, planner, done-check,
status and task ids. The pipeline (eyrie.stages.PIPELINE) is an ordered list of them; `advance`,
cancel, retry, status, the workers' queues and the Kubernetes Jobs loop over that list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eyrie.core.run_config import RunConfigBase
from eyrie.core.section import Section
from eyrie.data.manifest import Layout, RunManifest
from eyrie.work.queue import enqueue, job_errors, job_state, task_result, workers_on
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind

LIVE_JOB_STATES = {"queued", "started", "scheduled", "deferred"}


@dataclass
class Started:
    """What a user's start did: its run manifest and the tasks it enqueued now, or (while its
    planning task runs on its queue) that task's kind."""

    manifest: RunManifest | None = None
    enqueued: int = 0
    planning: TaskKind | None = None


@dataclass
class RunView:
    """What a stage's control side reads of one run: Redis, the store, the run's config (None for a
    run made before configs were kept for stages started alone) and the run manifest (None before
    the run is planned)."""

    conn: Any
    store: Any
    run: str
    config: RunConfigBase | None = None
    manifest: RunManifest | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.run)


class PipelineStage:
    """One stage. A subclass sets the class attributes and its checks; the base runs the rest.

    `planner`: the task kind that plans the stage on its own queue (None: nothing to plan);
    `work`: the task kind that does its work; `side_tasks`: others it runs (a base drafter's fetch).
    `start` is idempotent: it plans the stage until it is planned, then enqueues what is missing.
    However a stage is started (`eyrie run`, `eyrie <name>`, POST /runs), the run's config is kept
    and `advance` starts it; its planner plans it from that config."""

    name: ClassVar[str]
    queue: ClassVar[str]
    # its sections of the run config, each its settings class, the last its own (frozen once planned); the
    # run config is built from them (eyrie.stages.run_config)
    sections: ClassVar[dict[str, type[Section]]] = {}
    planner: ClassVar[TaskKind | None] = None
    work: ClassVar[TaskKind]
    side_tasks: ClassVar[tuple[TaskKind, ...]] = ()
    starts_alone: ClassVar[bool] = False  # a user may start it on its own (`eyrie <name>`, POST /runs?stage=)
    shown: ClassVar[bool] = True  # has a status of its own in a run's status (`status`)
    worker: ClassVar[str]  # the service whose workers work its queue (the demo's log name)
    needs_vllm: ClassVar[bool] = False  # its workers run vLLM: a worker refuses to start without it
    reports_cache: ClassVar[bool] = False  # its workers report their cache's free space (for --plan)
    makes_states: ClassVar[bool] = False  # once done, the run's states are complete (eyrie.runs.reuse)

    @classmethod
    def task_kinds(cls) -> tuple[TaskKind, ...]:
        return tuple(k for k in (cls.planner, cls.work, *cls.side_tasks) if k is not None)

    def planned(self, view: RunView) -> bool:
        raise NotImplementedError

    def done(self, view: RunView) -> bool:
        raise NotImplementedError

    def start(self, view: RunView) -> bool:
        """The one way a stage starts (`advance` calls it for the next stage of the run's config): planned
        first, then what is missing enqueued. False where nothing was enqueued (nothing runs now)."""
        return self.enqueue_work(view) if self.planned(view) else self.plan(view)

    def plan(self, view: RunView) -> bool:
        """Its planning task, first in its queue; a user's start (`eyrie run`, `eyrie <name>`) calls
        it on a planned stage too: planned again, checked against its plan, what is missing enqueued."""
        if self.planner is None:
            return self.enqueue_work(view)
        enqueue(view.conn, self.planner, {"run": view.run}, at_front=True)
        return True

    def enqueue_work(self, view: RunView) -> bool:
        enqueue(view.conn, self.work, {"run": view.run})
        return True

    def in_run(self, view: RunView) -> bool:
        """Whether the run's config names this stage (a run with no config kept runs none by itself)."""
        return view.config is not None and (view.config.stages is None or self.name in view.config.stages)

    def settings_in(self, config):
        """Its own settings: the last of its sections of the run config."""
        return getattr(config, self.own_section()) if self.sections else None

    @classmethod
    def own_section(cls) -> str | None:
        """The name of its own section (the last of its sections)."""
        return next(reversed(cls.sections), None)

    def pipeline_start_tasks(self, view: RunView) -> tuple[TaskKind, ...]:
        """What `eyrie run` starts ahead of the stage (nothing by default), each with the run as its payload."""
        return ()

    def on_pipeline_start(self, view: RunView) -> None:
        for kind in self.pipeline_start_tasks(view):
            enqueue(view.conn, kind, {"run": view.run})

    def on_retry(self, view: RunView) -> None:
        """What `eyrie retry` undoes of the stage before the pipeline advances (nothing by default)."""

    def check_start(self, store, run: str, section, dataset=None) -> None:
        """What starting the stage now would refuse (other settings than its plan, a stage before
        it not finished, a dataset with no usable row), raised before anything is written: a
        refused command changes nothing, so a cancelled run stays cancelled (eyrie.stages.start_checks)."""

    def tasks_left(self, view: RunView) -> list[str]:
        """The task ids of its planned work not finished yet."""
        return [] if self.done(view) else [self.work.task_id(view.run)]

    def task_ids(self, view: RunView) -> list[str]:
        """Every task id of the run's stage (its planner's and side tasks' included)."""
        return [kind.task_id(view.run) for kind in self.task_kinds()]

    def planner_states(self, view: RunView) -> dict[str, dict]:
        """The state and errors of its planner and side tasks, by task kind, where they ran."""
        states = {}
        for kind in (self.planner, *self.side_tasks):
            if kind is not None and (state := job_state(view.conn, kind.task_id(view.run))):
                states[kind.name] = {"state": state, "errors": job_errors(view.conn, [kind.task_id(view.run)])}
        return states

    def refused(self, view: RunView) -> StageStatus | None:
        """Before it is planned: failed with its planner's refusal, where it refused (a stage
        started on its own shows it nowhere else); else None."""
        task = self.planner.task_id(view.run) if self.planner else None
        if task is None or job_state(view.conn, task) != "finished":
            return None
        result = task_result(view.conn, task)
        if result.get("status") != "refused":
            return None
        return StageStatus(state="failed", errors=[f"{task}: {result['error']}"], workers=workers_on(view.conn, self.queue))

    def status(self, view: RunView) -> StageStatus | None:
        """Its status once planned (before: its planner's refusal, if any; else None)."""
        if not self.planned(view):
            return self.refused(view)
        ids = [self.work.task_id(view.run)]
        state = "done" if self.done(view) else (job_state(view.conn, ids[0]) or "missing")
        return StageStatus(state=state_of(int(state == "done"), 1, {} if state == "done" else {state: 1}),
                           total=1, done=int(state == "done"), jobs={} if state == "done" else {state: 1},
                           workers=workers_on(view.conn, self.queue), errors=job_errors(view.conn, ids))


def state_of(done: int, total: int, jobs: dict, processed: int = 0) -> str:
    """A stage's state from its finished tasks, its unfinished ones by RQ state, and its progress."""
    if done == total:
        return "done"
    if any(s in LIVE_JOB_STATES for s in jobs):
        return "in_progress"
    if jobs.get("failed"):
        return "failed"
    return "in_progress" if processed else "pending"
