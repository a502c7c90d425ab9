"""The extract stage: the target's hidden states of every generated sample, one task per shard,
planned (the storage budget checked first) by its `plan-extract` task on the extractor's workers,
which have the tokenizer and the target's config, however it is started."""

from __future__ import annotations

from eyrie.core.stage_settings import ExtractSettings
from eyrie.stages.base import RunView
from eyrie.stages.sharded import ShardedStage, sharded_status
from eyrie.stages.start_checks import check_extract
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind


class Extract(ShardedStage):
    name = queue = "extract"
    sections = {"extract": ExtractSettings}
    planner = TaskKind("plan-extract", "extract", "eyrie_extractor.plan.run_plan_extract_task")
    # through vLLM it reads the extraction server (where the chart renders one)
    work = TaskKind("extract", "extract", "eyrie_extractor.shard.run_extract_shard", gpu=True,
                    jobs=("extract-server", "extract"))
    worker, starts_alone = "extractor", True
    makes_states = True  # once every shard is extracted, a run with the same settings may train on them

    def check_start(self, store, run: str, section, dataset=None) -> None:
        check_extract(store, run, section)

    def planned(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.extract is not None

    def total(self, view: RunView) -> int:
        return view.manifest.extract.samples

    def status(self, view: RunView) -> StageStatus | None:
        if not self.planned(view):
            return self.refused(view)
        status = sharded_status(view, self, self.total(view))
        status.projected_bytes = view.manifest.extract.projected_bytes
        return status
