"""The train stage: planned by its `plan-train` task on the trainer's workers (the settings
checked, the base drafter fetched and checked in the trainer's cache, the plan recorded in the run
manifest), then one task that trains the drafter with speculators, evaluates and exports it."""

from __future__ import annotations

import re
from typing import NamedTuple

from eyrie.core.stage_settings import TrainSettings
from eyrie.data.charts import chart_series
from eyrie.stages.base import PipelineStage, RunView, state_of
from eyrie.stages.start_checks import check_train
from eyrie.work import progress
from eyrie.work.queue import job_errors, job_state, workers_on
from eyrie.work.status_models import TrainStatus
from eyrie.work.task_kinds import TaskKind


class Train(PipelineStage):
    name = queue = "train"
    sections = {"train": TrainSettings}
    planner = TaskKind("plan-train", "train", "eyrie_trainer.plan.run_plan_train_task")
    work = TaskKind("train", "train", "eyrie_trainer.runner.run_train_task", gpu=True, timeout_s=7 * 24 * 3600,
                    jobs=("train",), reads_on_demand=("extract-server",))
    # the base drafter, fetched and checked by the trainer while the target still serves
    side_tasks = (TaskKind("fetch", "train", "eyrie_trainer.plan.run_fetch_task"),)
    worker, starts_alone = "trainer", True
    reports_cache = True  # its local copy of the hidden states

    def check_start(self, store, run: str, section, dataset=None) -> None:
        check_train(store, run, section)

    def planned(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.train is not None

    def done(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.drafter is not None

    def pipeline_start_tasks(self, view: RunView) -> tuple[TaskKind, ...]:
        return self.side_tasks[:1] if view.config.train.base else ()

    def status(self, view: RunView) -> TrainStatus | None:
        return train_status(view, self) if self.planned(view) else self.refused(view)


def train_status(view: RunView, stage: Train) -> TrainStatus:
    """The one training task: steps as its progress, the latest loss and per-TTT-step accuracy,
    checkpoints, τ per checkpoint once evaluated, the exported drafter, and the charts' series."""
    conn, manifest = view.conn, view.manifest
    live = progress.read(conn, view.run, stage.name).get("0", {})
    job = stage.work.task_id(view.run)
    state = job_state(conn, job) or "missing"
    done = manifest.drafter is not None
    total, step = live.get("total_steps") or 0, live.get("step", 0)
    elapsed = max(1e-6, live.get("updated_at", 0) - live.get("started", 0))
    steps_this_attempt = step - live.get("resumed_at_step", 0)
    rate = steps_this_attempt / elapsed if steps_this_attempt > 0 else None
    evaluation = evaluation_of(view)
    dropped = left_out(view, live)
    return TrainStatus(
        state="done" if done else state_of(0, 1, {state: 1}, step),
        total=total, done=step, tokens=live.get("tokens", 0),
        tok_per_s=round(live.get("tokens", 0) / elapsed, 1) if live.get("tokens") else None,
        eta_s=0.0 if done else (round((total - step) / rate, 1) if rate and total else None),
        phase="done" if done else live.get("phase", "pending"), epoch=live.get("epoch"),
        epochs=manifest.train.epochs, steps_per_epoch=live.get("steps_per_epoch"), loss=live.get("loss"),
        val_loss=live.get("val_loss"),
        acc=live.get("acc"), path=live.get("path"), notes=live.get("notes", []), on_demand=live.get("on_demand", 0),
        dropped=sum(d.count for d in dropped), drop_reasons=[d.reason for d in dropped],
        checkpoints=live.get("checkpoints", []), evaluation=evaluation, drafter=manifest.drafter,
        verify=manifest.verify, charts=train_charts(view, evaluation),
        waiting_for=[live["waiting_for"]] if live.get("waiting_for") and live.get("phase") == "waiting" else [],
        workers=workers_on(conn, stage.queue), errors=job_errors(conn, [job]), jobs={state: 1},
        params=manifest.train.model_dump())


class Dropped(NamedTuple):
    reason: str  # speculators' words, its numbers (a row, an attempt) as N: one reason for many samples
    count: int
    example: dict | None  # one sample: its id and speculators' own words, where the record names them


def left_out(view: RunView, live: dict) -> list[Dropped]:
    """The samples training left out, by reason, most first: the record over every attempt
    (train/samples.json, eyrie_trainer.ledger: left out and never read since; the trainer saves it
    with each checkpoint and within eyrie_trainer.runner.LEDGER_SAVE_S of a step that left one
    out), else, before its first save, this attempt's live count. Status, `eyrie logs` and the
    dashboard count from here."""
    by_reason: dict[str, list[tuple[str | None, str]]] = {}
    if view.store.exists(view.layout.train_samples):
        dropped = view.store.get_json(view.layout.train_samples)["dropped"].items()
    else:
        dropped = [(None, (live.get("drop_reasons") or ["see the trainer's log"])[-1])] * live.get("dropped", 0)
    for sample, why in dropped:
        by_reason.setdefault(re.sub(r"\d+", "N", why), []).append((sample, why))
    return sorted((Dropped(reason, len(found), {"sample_id": found[0][0], "detail": found[0][1]} if found[0][0]
                           else None) for reason, found in by_reason.items()), key=lambda d: -d.count)


def train_charts(view: RunView, evaluation: dict | None) -> dict:
    """chart_series of the run (its manifest planned): the curve live from Redis while it trains
    (the step just done), the store's copy (written with each checkpoint) once it is exported or
    when Redis has none."""
    curve = None if view.manifest.drafter else progress.read_curve(view.conn, view.run, Train.name)
    if curve is None and view.store.exists(view.layout.train_curve):
        curve = view.store.get_json(view.layout.train_curve)
    return chart_series(evaluation, view.manifest.verify, curve)


def evaluation_of(view: RunView) -> dict | None:
    """train/evaluation.json: tau per checkpoint, once training evaluated them."""
    return view.store.get_json(view.layout.evaluation) if view.store.exists(view.layout.evaluation) else None
