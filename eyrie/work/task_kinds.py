"""Task kinds: each the one RQ function a queue's workers run for one kind of task, its queue,
whether it holds the GPUs, its timeout and its task ids. A stage (eyrie.stages) declares its own.

The shared package names a service's code only as text: `entry` imports it on first use, so
eyrie/ has no import of a service package (the services import eyrie/, never the reverse)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 48 * 3600
QUEUE_PREFIX = "eyrie-"
ON_TASK_DONE = "eyrie.runs.pipeline.on_task_done"  # the one callback: RQ's on_success of every task
CALLBACKS = frozenset({ON_TASK_DONE})
_DECLARED: dict[str, "TaskKind"] = {}  # every task kind, by name, as its stage declares it


@dataclass(frozen=True)
class TaskKind:
    name: str  # also the prefix of its task ids
    queue: str  # RQ queue `eyrie-<queue>`; its workers run every task kind of that queue
    func: str  # the task function's dotted name (RQ enqueues by name)
    gpu: bool = False  # holds the GPU lease while it works
    timeout_s: int = DEFAULT_TIMEOUT_S
    # on Kubernetes under Kueue, the chart's Jobs that serve its queue, created in this order when
    # it is enqueued: the servers it reads first (the target, the extraction server), then the one
    # that drains the queue
    jobs: tuple[str, ...] = ()
    # the server Jobs it reads besides, for a run that trains on demand (extract.storage hybrid or
    # online), created before its own; they stay up until its queue drains
    reads_on_demand: tuple[str, ...] = ()

    def __post_init__(self):
        _DECLARED[self.name] = self

    def task_id(self, run: str, shard: int = 0) -> str:
        return task_id(self.name, run, shard)


def task_funcs() -> frozenset[str]:
    """The only functions a worker runs: a payload naming anything else (os.system, say) is
    refused unexecuted, whoever could write to Redis."""
    return frozenset(k.func for k in _DECLARED.values())


def jobs_for_queue(queue: str, on_demand: bool = False) -> tuple[str, ...]:
    """The Jobs that serve a queue's tasks, as its task kinds declare them, in creation order: the
    servers first, the Job that drains the queue last. on_demand: for a run that trains on demand."""
    kinds = [k for k in _DECLARED.values() if k.queue == queue]
    reads = [job for k in kinds for job in k.reads_on_demand] if on_demand else []
    return tuple(dict.fromkeys([*reads, *(job for k in kinds for job in k.jobs)]))


def servers_done(queue: str, on_demand: bool = False) -> tuple[str, ...]:
    """The server Jobs no task needs once the queue has drained: every Job of the queue but the one
    that drains it, less those another queue's tasks read on demand (the extraction server stays
    after extraction where training reads it)."""
    kept = {job for k in _DECLARED.values() if k.queue != queue for job in k.reads_on_demand} if on_demand else set()
    return tuple(job for job in jobs_for_queue(queue, on_demand)[:-1] if job not in kept)


def gpu_queues() -> frozenset[str]:
    """The queues whose workers run tasks in their own process (the model stays loaded)."""
    return frozenset(k.queue for k in _DECLARED.values() if k.gpu)


def queue_name(queue: str) -> str:
    return f"{QUEUE_PREFIX}{queue}"


def task_id(kind: str, run: str, shard: int = 0) -> str:
    return f"{kind}-{run}-{shard:05d}"


def entry(dotted: str):
    """A function (or class) of a service by its dotted name, imported now."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)
