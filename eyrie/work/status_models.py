"""A run's status as typed models: what `eyrie status --json`, the API, /metrics and the dashboard read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from eyrie.data.manifest import Counts
from eyrie.work.inference import Endpoint

State = Literal["pending", "in_progress", "done", "failed", "cancelled"]


class ActiveTask(BaseModel):
    """One running task, by worker: what it has done and its own rate."""

    shard: int
    worker: str | None = None
    done: int = 0
    tokens: int = 0
    bytes: int = 0
    tok_per_s: float = 0.0


class _Stated(BaseModel):
    state: State  # first in the JSON, before the counts (fields come in the reverse order of the bases)


class StageStatus(Counts, _Stated):  # its counts: the shard manifests' own, summed
    """One stage of a run: the record (finished shards' manifests) plus live progress of the rest."""

    in_flight: int = 0
    waiting_for: list[str] = Field(default_factory=list)
    shards_total: int | None = None
    shards_done: int | None = None
    jobs: dict[str, int] = Field(default_factory=dict, description="Unfinished tasks by RQ state.")
    workers: int = 0
    active: list[ActiveTask] = Field(default_factory=list)
    skip_reasons: dict[str, int] = Field(default_factory=dict)
    errors: list[str] = Field(default_factory=list, description="Last line of each failed task's error.")
    tok_per_s: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    projected_bytes: int | None = None


class TrainStatus(StageStatus):
    """The one training task: steps as its progress, loss and accuracy, evaluation and export."""

    phase: str = "pending"
    epoch: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    acc: list[float] | None = None
    path: dict | None = Field(None, description="The attention/loss path speculators took.")
    notes: list[str] = Field(default_factory=list)
    on_demand: int = Field(0, description="Training samples whose hidden states the extraction service makes.")
    dropped: int = Field(0, description="Samples speculators left out: the extraction service's retries "
                                        "exhausted, or states whose token ids did not match. Once the trainer "
                                        "recorded them (train/samples.json), those never trained on in any "
                                        "attempt; before, this attempt's left-out samples. `eyrie logs` and "
                                        "the dashboard count the same (eyrie.stages.train.left_out).")
    drop_reasons: list[str] = Field(default_factory=list, description="Their reasons, most samples first, "
                                                                      "speculators' words.")
    checkpoints: list = Field(default_factory=list)
    evaluation: dict | None = None
    drafter: dict | None = None
    verify: dict | None = None
    charts: dict | None = None
    params: dict = Field(default_factory=dict)


class TaskState(BaseModel):
    state: str
    errors: list[str] = Field(default_factory=list, description="Last line of each failed attempt's error.")


class PipelineStatus(BaseModel):
    """Every run's: its stages (a stage started alone: that one), whether the chain is blocked, and the
    stages' planners and side tasks (e.g. plan-extract, the base drafter's fetch) by task kind, once enqueued."""

    stages: list[str] = Field(default_factory=list)
    blocked: str | None = None
    tasks: dict[str, TaskState] = Field(default_factory=dict)


class GpuHolder(BaseModel):
    """The GPU leases (one per device set): every holder and every waiter, with the host and GPUs."""

    holder: dict | None = Field(None, description="The oldest holder (owner, devices, gpus, gpu_host, host, since).")
    holders: list[dict] = Field(default_factory=list, description="Every live lease, oldest first.")
    waiting: list[str] = Field(default_factory=list, description="The waiters' owners.")
    waiters: list[dict] = Field(default_factory=list, description="Every waiter: owner, devices, gpus, host, since.")


class RunStatus(BaseModel):
    run: str
    created_at: str | None = Field(None, description="When it was planned (None while its planning task runs).")
    target: dict
    dataset: dict
    stages: dict[str, TrainStatus | StageStatus]
    inference: Endpoint | None = None
    gpu_lease: GpuHolder | None = None
    pipeline: PipelineStatus | None = None
    cancelled: str | None = None


class StageSummary(BaseModel):
    state: State
    total: int
    done: int
    skipped: int
    failed: int
    eta_s: float | None = None


class RunSummary(BaseModel):
    """One line of `GET /runs` and `eyrie runs`."""

    run: str
    created_at: str | None = None
    target: str | None = None
    state: State
    active: bool
    blocked: str | None = None
    cancelled: str | None = None
    stages: dict[str, StageSummary]


class QueueTasks(BaseModel):
    """`GET /queues/{name}`: a queue's tasks that still need a worker, by RQ state, and `live`,
    their sum, which KEDA scales the generator workers on."""

    queue: str
    queued: int
    started: int
    scheduled: int
    deferred: int
    live: int
