"""Plan (or continue) the train stage of a run, by its planning task on the trainer's workers
(`PlanTrain`), however it is started: check extract is done, fix the settings in the run manifest
(a rerun must match them; the base drafter fetched and checked), enqueue the one training task,
which trains from that plan alone. And a pipeline's base drafter fetched and checked ahead of it
(`FetchBase`)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.provenance import RUN_CONFIG, as_used
from eyrie.core.recipe import pack_length, trainer_device
from eyrie.core.stage_settings import TrainSettings
from eyrie.core.target import text_config
from eyrie.data.manifest import BaseDrafter, Layout, RunManifest, TrainParams
from eyrie.stages import FETCH, PLAN_TRAIN, TRAIN
from eyrie.stages.run_config import stored_config
from eyrie.stages.start_checks import check_train
from eyrie.stages.train import Train
from eyrie.tasks.executor import StageTask, execute
from eyrie.tasks.planner import PlannerTask
from eyrie.work import progress
from eyrie.work.cancel import block
from eyrie.work.queue import enqueue
from eyrie_trainer.base import prepare_base
from eyrie_trainer.data import done_samples, heldout_ids


def plan_train(conn, store, run: str, request: TrainSettings, cache_dir: Path, device: str,
               given_by: str = RUN_CONFIG) -> tuple[RunManifest, int]:
    """The run's train plan made now (base drafter fetched and checked) or checked against, then
    the training task enqueued unless the drafter is exported. `device`: where training runs (the
    recipe's pack length); `given_by`: who gave `request` (eyrie.core.provenance)."""
    manifest, layout = check_train(store, run, request), Layout(run)
    if manifest.train is None:
        manifest.train = plan(store, manifest, request, cache_dir, device)
        manifest.settings[Train.own_section()] = as_used(request, given_by)
        store.put_json(layout.manifest, manifest.model_dump())
        progress.reset(conn, run, TRAIN.name)
    if store.exists(layout.drafter_manifest):
        return manifest, 0
    return manifest, int(enqueue(conn, TRAIN, {"run": run}))


def plan(store, manifest: RunManifest, request: TrainSettings, cache_dir: Path, device: str = "cpu") -> TrainParams:
    done = done_samples(store, manifest.run)
    samples = len(done)
    heldout = request.heldout_for(samples)
    if samples - heldout < 1:
        raise EyrieError(f"run {manifest.run} has {samples} extracted samples: too few to train on "
                         f"and hold {heldout} out for evaluation.",
                         "generate more samples, or pass a smaller --heldout.")
    target_vocab = text_config(manifest.target.model, manifest.target.trust_remote_code).vocab_size
    base = check_base_drafter(manifest, request, cache_dir) if request.base else None
    draft_vocab = base.draft_vocab if base else min(request.draft_vocab, target_vocab)
    recipe = request.recipe(_training_tokens(done, heldout, pack_length(request.seq_len, device)), device)
    return TrainParams(
        epochs=recipe.epochs, max_steps=request.max_steps, draft_vocab=draft_vocab,
        vocab_mapping="base" if request.base else "frequency", lr=recipe.lr, warmup=recipe.warmup,
        schedule=recipe.schedule, total_seq_len=recipe.seq_len, ttt_steps=request.ttt_steps,
        train_samples=samples - heldout, heldout_samples=heldout, loggers=list(request.loggers),
        base=base, speculators_version=version("speculators"), recipe=recipe.statement())


def _training_tokens(samples: list[dict], heldout: int, pack: int) -> int:
    """The tokens the training samples give the trainer, each cut at the pack length."""
    held = heldout_ids(samples, heldout)
    return sum(min(s["seq_len"], pack) for s in samples if s["sample_id"] not in held)


def check_base_drafter(manifest: RunManifest, request: TrainSettings, cache_dir: Path) -> BaseDrafter:
    """Fetched, converted and checked against the target and the run's layers now, before any
    training is planned: a mismatch is refused here, naming both values."""
    _, info = prepare_base(request.base, request.base_revision, manifest.target.model,
                           manifest.extract.aux_layers, request.given().get("draft_vocab"), cache_dir / "base",
                           manifest.target.trust_remote_code)
    return BaseDrafter(**info.model_dump(exclude={"path"}))


class PlanTrain(PlannerTask):
    """The train stage planned from the settings given where it was started alone, else from the
    run config, on a trainer's worker (its cache holds the base drafter); the training task
    enqueued. A refusal (too few samples, a base drafter that does not fit, other settings) blocks
    the run until the user starts it again (eyrie.tasks.planner)."""

    stage, Request = PLAN_TRAIN, TrainSettings

    def plan(self, request: TrainSettings) -> dict:
        manifest, enqueued = plan_train(self.conn, self.store, self.run_name, request, Path(self.settings.cache_dir),
                                         trainer_device(self.settings.device), self.given_by())
        return {"train_samples": manifest.train.train_samples, "enqueued": enqueued}


def run_plan_train_task(payload: dict) -> dict:
    """RQ entry point (train queue)."""
    return execute(PlanTrain, payload)


class FetchBase(StageTask):
    """A pipeline's base drafter fetched, converted and checked by the trainer while the target is
    still serving, so a mismatch shows before any GPU work; one that cannot be had or does not
    fit blocks the run (the user's to fix). No done-check: the conversion is cached (base.py)."""

    stage = FETCH

    def run(self) -> dict:
        config = stored_config(self.store, self.run_name)
        if config is None or not config.train.base:
            return self.result("no_base")
        try:
            path, info = self._prepare(config)
        except EyrieError as exc:
            block(self.conn, self.run_name, exc)
            return self.result("refused", error=str(exc))
        return self.result("ready", path=str(path), **info.model_dump(exclude={"path"}))

    def _prepare(self, config):
        train = config.train
        trust = config.serve.trust_remote_code
        layers = resolve_aux_layers(config.extract.layers, text_config(config.target.model, trust).num_hidden_layers)
        return prepare_base(train.base, train.base_revision, config.target.model, layers,
                            train.given().get("draft_vocab"), Path(self.settings.cache_dir) / "base", trust)


def run_fetch_task(payload: dict) -> dict:
    """RQ entry point (train queue)."""
    return execute(FetchBase, payload)
