"""A pipeline stage, declared: its name, queue, settings sections, task kinds, planner, done-check,
status and task ids. The pipeline (eyrie.stages.PIPELINE) is an ordered list of them; `advance`,
cancel, retry, status, the workers' queues and the Kubernetes Jobs loop over that list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eyrie.data.manifest import Layout, RunManifest
from eyrie.work.queue import enqueue, job_errors, job_state, workers_on
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind, entry

LIVE_JOB_STATES = {"queued", "started", "scheduled", "deferred"}


@dataclass
class Started:
    """What starting a stage did: its run manifest and the tasks it enqueued now, or (while its
    planning task runs on its queue) that task's kind."""

    manifest: RunManifest | None = None
    enqueued: int = 0
    planning: TaskKind | None = None


@dataclass
class RunView:
    """What a stage's control side reads of one run: Redis, the store, the pipeline's config
    (None for a stage started on its own) and the run manifest (None before the run is planned)."""

    conn: Any
    store: Any
    run: str
    config: Any = None  # eyrie.runs.pipeline.RunConfig
    manifest: RunManifest | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.run)


class PipelineStage:
    """One stage. A subclass sets the class attributes and its checks; the base runs the rest.

    `planner`: the task kind that plans the stage on its own queue (None: its work task plans it);
    `work`: the task kind that does its work; `side_tasks`: others it runs (a base drafter's fetch).
    `start` is idempotent: it enqueues the planner until the stage is planned, then what is missing."""

    name: ClassVar[str]
    queue: ClassVar[str]
    sections: ClassVar[tuple[str, ...]] = ()  # its sections of the run config (frozen once planned)
    planner: ClassVar[TaskKind | None] = None
    work: ClassVar[TaskKind]
    side_tasks: ClassVar[tuple[TaskKind, ...]] = ()
    starter: ClassVar[str | None] = None  # dotted name: plans and starts it here (start_alone)
    starts_alone: ClassVar[bool] = False  # a user may start it on its own (`eyrie <name>`, POST /runs?stage=)
    shown: ClassVar[bool] = True  # has a status of its own in a run's status (`status`)
    worker: ClassVar[str]  # the service whose workers work its queue (the demo's log name)
    needs_vllm: ClassVar[bool] = False  # its workers run vLLM: a worker refuses to start without it
    reports_cache: ClassVar[bool] = False  # its workers report their cache's free space (for --plan)

    @classmethod
    def task_kinds(cls) -> tuple[TaskKind, ...]:
        return tuple(k for k in (cls.planner, cls.work, *cls.side_tasks) if k is not None)

    def planned(self, view: RunView) -> bool:
        raise NotImplementedError

    def done(self, view: RunView) -> bool:
        raise NotImplementedError

    def start(self, view: RunView) -> bool:
        """Enqueue what the stage needs now; False when it finished without a task (nothing runs)."""
        if self.planner is not None and not self.planned(view):
            enqueue(view.conn, self.planner, {"run": view.run})
        else:
            self.enqueue_work(view)
        return True

    def enqueue_work(self, view: RunView) -> None:
        enqueue(view.conn, self.work, {"run": view.run})

    def settings_in(self, config):
        """Its own settings: the last of its sections of the run config."""
        return getattr(config, self.sections[-1]) if self.sections else None

    def on_pipeline_start(self, view: RunView) -> None:
        """What `eyrie run` starts ahead of the stage (nothing by default)."""

    def start_alone(self, settings, conn, store, run: str, section, dataset=None) -> Started:
        """The stage on its own from its settings section, planned here (or checked against its plan)."""
        return Started(*entry(self.starter)(conn, store, run, section))

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

    def status(self, view: RunView) -> StageStatus | None:
        """Its status once planned (None before)."""
        if not self.planned(view):
            return None
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
