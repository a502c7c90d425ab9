"""A stage's planning task (plan-extract, plan-train, ...): what to plan, and the refusal contract.

However a stage is started its planner plans it, on the stage's own queue, where its data and tools
are. What to plan: its section of the run's kept config, the one source (`eyrie run` keeps the
pipeline's; `eyrie extract`, POST /runs?stage= keep one naming that stage). A refusal
(settings the data cannot carry, a stage before not finished, a base drafter that does not fit)
blocks the run, shown by status, and is the task's result: {"status": "refused", "error", "fix"},
which the command that waits for it prints as its one-line error (eyrie.work.planning)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel

from eyrie.core.errors import EyrieError
from eyrie.core.provenance import given_by
from eyrie.stages import PIPELINE
from eyrie.stages.run_config import stored_config
from eyrie.tasks.executor import StageTask
from eyrie.work.cancel import block


class PlannerTask(StageTask):
    """A subclass sets `stage` (the planner's task kind, as its stage declares it) and `Request`
    (the settings model of that stage's section) and plans in `plan`, returning its result's fields.
    Its payload is the run alone. No done-check: a plan made already is checked against and what is
    missing enqueued again."""

    Request: ClassVar[type[BaseModel]]

    def request(self) -> BaseModel:
        """What to plan: the run's kept config's section."""
        planned = next(s for s in PIPELINE if s.planner == self.stage)
        config = stored_config(self.store, self.run_name)
        if config is None:
            raise EyrieError(f"run {self.run_name}: nothing to plan {planned.name} from (no run config kept).",
                             f"start it with `eyrie run --config run.yaml` or `eyrie {planned.name} "
                             f"--run {self.run_name}`.")
        return self.Request.model_validate(getattr(config, planned.own_section()))

    def given_by(self) -> str:
        """Who gave the settings planned: a stage command's flags or the run config (eyrie.core.provenance)."""
        planned = next(s for s in PIPELINE if s.planner == self.stage)
        return given_by(stored_config(self.store, self.run_name), planned.name)

    def plan(self, request) -> dict:
        """Plan the stage (or check `request` against its plan) and enqueue what is missing."""
        raise NotImplementedError

    def run(self) -> dict:
        try:
            return {"run": self.run_name, **self.result("planned", **self.plan(self.request()))}
        except EyrieError as exc:
            block(self.conn, self.run_name, exc)
            return {"run": self.run_name, **self.result("refused", error=exc.problem, fix=exc.fix)}
