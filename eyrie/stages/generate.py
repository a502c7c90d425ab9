"""The generate stage: the target answers the dataset's prompts, one task per shard of rows,
planned by the first task on its own queue (the dataset read, its rows copied into the store as
input shards) after a cheap check where it is started (the dataset reachable, a usable row)."""

from __future__ import annotations

from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.stages.base import RunView, state_of
from eyrie.stages.sharded import ShardedStage
from eyrie.stages.start_checks import check_generate
from eyrie.work import keys
from eyrie.work.queue import job_errors, job_state, task_result, workers_on
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind


class Generate(ShardedStage):
    name = queue = "generate"
    sections = {"dataset": DatasetSection, "generate": GenerateSettings}
    planner = TaskKind("plan-generate", "generate", "eyrie_generator.plan.run_plan_generate_task")
    work = TaskKind("generate", "generate", "eyrie_generator.shard.run_generate_shard", jobs=("serve",))
    worker, starts_alone = "generator", True

    def check_start(self, store, run: str, section, dataset=None) -> None:
        check_generate(store, run, section, dataset)  # at once: the dataset reachable, a usable row

    def planned(self, view: RunView) -> bool:
        return view.manifest is not None

    def enqueue_work(self, view: RunView) -> bool:
        """Its planner enqueues its tasks; a shard that failed for good waits for `eyrie retry`."""
        return False

    def total(self, view: RunView) -> int:
        return view.manifest.dataset.row_end - view.manifest.dataset.row_start

    def status(self, view: RunView) -> StageStatus | None:
        task = self.planner.task_id(view.run)  # the run's first task: its planning, shown as it goes
        state, planned = job_state(view.conn, task), self.planned(view)
        # its result is read only where it can hold a refusal: a planned run's refused rerun blocks
        # the run, so the common case (planned, not blocked) costs no job fetch on every poll
        refusable = state == "finished" and (not planned or view.conn.exists(keys.blocked(view.run)))
        result = task_result(view.conn, task) if refusable else {}
        refusal = [f"{task}: {result['error']}"] if result.get("status") == "refused" else []
        if planned:
            status = super().status(view)
            status.errors = refusal + status.errors  # a rerun refused (other settings): the run as it was
            return status
        if state is None:
            return None
        return StageStatus(state="failed" if refusal else state_of(0, 1, {state: 1}), jobs={state: 1}, shards_done=0,
                           errors=refusal or job_errors(view.conn, [task]), workers=workers_on(view.conn, self.queue),
                           waiting_for=["planning"])
