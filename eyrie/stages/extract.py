"""The extract stage: the target's hidden states of every generated sample, one task per shard,
planned (the storage budget checked first) by the extractor's workers, which have the tokenizer
and the target's config."""

from __future__ import annotations

from eyrie.stages.base import RunView
from eyrie.stages.sharded import ShardedStage, sharded_status
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind, entry


class Extract(ShardedStage):
    name = queue = "extract"
    sections = ("extract",)
    planner = TaskKind("plan-extract", "extract", "eyrie_extractor.plan.run_plan_extract_task")
    # through vLLM it reads the extraction server (where the chart renders one)
    work = TaskKind("extract", "extract", "eyrie_extractor.shard.run_extract_shard", gpu=True,
                    jobs=("extract-server", "extract"))
    starter = "eyrie_extractor.plan.start_extract"
    worker, starts_alone = "extractor", True

    def planned(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.extract is not None

    def enqueue_work(self, view: RunView) -> None:
        """Checked against its plan, then what is missing enqueued (by its own starter)."""
        entry(self.starter)(view.conn, view.store, view.run, view.config.extract)

    def total(self, view: RunView) -> int:
        return view.manifest.extract.samples

    def status(self, view: RunView) -> StageStatus | None:
        if not self.planned(view):
            return None
        status = sharded_status(view, self, self.total(view))
        status.projected_bytes = view.manifest.extract.projected_bytes
        return status
