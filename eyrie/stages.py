"""The stages, in one table: for each RQ task, the queue it runs on, its function's dotted name,
whether it holds the GPUs, its job timeout and its task ids. The queues' allow-list
(eyrie.queue.EyrieJob), the workers' queues and the task ids all derive from it.

The shared package names a service's code only here, as text: `entry` imports it on first use,
so eyrie/ has no import of a service package (the services import eyrie/, never the reverse)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 48 * 3600
QUEUE_PREFIX = "eyrie-"


@dataclass(frozen=True)
class Stage:
    name: str  # also the prefix of its task ids
    queue: str  # RQ queue `eyrie-<queue>`; its workers run every stage of that queue
    func: str  # the task function's dotted name (RQ enqueues by name)
    gpu: bool  # holds the GPU lease while it works
    timeout_s: int = DEFAULT_TIMEOUT_S
    start: str | None = None  # its planner's dotted name: plans (or checks) the stage, enqueues its tasks

    def task_id(self, run: str, shard: int = 0) -> str:
        return task_id(self.name, run, shard)


GENERATE = Stage("generate", "generate", "eyrie_generator.shard.run_generate_shard", gpu=False,
                 start="eyrie_generator.plan.start_generate")
# planned by the extractor's workers (the tokenizer and the model config are theirs)
PLAN_EXTRACT = Stage("plan-extract", "extract", "eyrie_extractor.plan.run_plan_extract_task", gpu=False)
EXTRACT = Stage("extract", "extract", "eyrie_extractor.shard.run_extract_shard", gpu=True,
                start="eyrie_extractor.plan.start_extract")
# the base drafter, fetched and checked by the trainer while the target still serves
FETCH = Stage("fetch", "train", "eyrie_trainer.plan.run_fetch_task", gpu=False)
TRAIN = Stage("train", "train", "eyrie_trainer.runner.run_train_task", gpu=True, timeout_s=7 * 24 * 3600,
              start="eyrie_trainer.plan.start_train")
# its own queue, worked where vLLM is (the inference image's verifier; `eyrie worker verify`); its
# timeout is set at enqueue from the run's plan (eyrie.pipeline.verify_timeout_s)
VERIFY = Stage("verify", "verify", "eyrie_trainer.verify.run_verify_task", gpu=True, timeout_s=7200)

STAGES = {s.name: s for s in (GENERATE, PLAN_EXTRACT, EXTRACT, FETCH, TRAIN, VERIFY)}
QUEUES = tuple(dict.fromkeys(s.queue for s in STAGES.values()))  # generate, extract, train, verify
STARTABLE = tuple(s.name for s in STAGES.values() if s.start)  # a user may start these on their own
GPU_QUEUES = tuple(q for q in QUEUES if any(s.gpu for s in STAGES.values() if s.queue == q))
# The only functions a worker runs, and the only callback: a payload naming anything else
# (os.system, say) is refused unexecuted, whoever could write to Redis.
TASK_FUNCS = frozenset(s.func for s in STAGES.values())
ON_TASK_DONE = "eyrie.pipeline.on_task_done"
CALLBACKS = frozenset({ON_TASK_DONE})


def queue_name(queue: str) -> str:
    return f"{QUEUE_PREFIX}{queue}"


def task_id(stage: str, run: str, shard: int = 0) -> str:
    return f"{stage}-{run}-{shard:05d}"


def on_queue(queue: str) -> list[Stage]:
    return [s for s in STAGES.values() if s.queue == queue]


def entry(dotted: str):
    """A function (or class) of a service by its dotted name, imported now."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def preload(queue: str) -> None:
    """A worker imports its stages' modules once at its start, not in every task."""
    for stage in on_queue(queue):
        importlib.import_module(stage.func.rpartition(".")[0])
