"""Start (or continue) the train stage of a run: check extract is done, fix the settings in the
run manifest (a rerun must match them), enqueue the one training task; and a pipeline's base
drafter fetched and checked ahead of it (`FetchBase`)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.stage_settings import TrainSettings
from eyrie.core.target import text_config
from eyrie.data.manifest import BaseDrafter, Layout, RunManifest, TrainParams, load_run_manifest
from eyrie.runs.pipeline import block, stored_config
from eyrie.stages import FETCH, TRAIN
from eyrie.tasks.executor import RunTask, StageTask, execute
from eyrie.work import progress
from eyrie.work.queue import enqueue
from eyrie_trainer.base import prepare_base
from eyrie_trainer.data import done_samples


class TrainTask(RunTask):
    """The JSON payload of a train task on the queue; `request` when the trainer is to plan it
    (the pipeline's train stage: the base drafter is fetched and checked by the trainer)."""

    request: TrainSettings | None = None


def ensure_plan(conn, store, run: str, request: TrainSettings, cache_dir: Path) -> RunManifest:
    """The run's train plan: made now (base drafter fetched and checked), or checked against."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    _require_extract_done(store, manifest, layout)
    if manifest.train is None:
        manifest.train = plan(store, manifest, request, cache_dir)
        store.put_json(layout.manifest, manifest.model_dump())
        progress.reset(conn, run, TRAIN.name)
    else:
        _check_same(manifest.train, request)
    return manifest


def start_train(conn, store, run: str, request: TrainSettings, cache_dir: Path) -> tuple[RunManifest, int]:
    manifest, layout = ensure_plan(conn, store, run, request, cache_dir), Layout(run)
    if store.exists(layout.drafter_manifest):
        return manifest, 0
    enqueued = enqueue(conn, TRAIN, {"run": run})
    return manifest, int(enqueued)


def _require_extract_done(store, manifest: RunManifest, layout: Layout) -> None:
    missing = [] if manifest.extract is None else [
        p.index for p in manifest.generate_shards if not store.exists(layout.extract_shard_manifest(p.index))]
    if manifest.extract is None or missing:
        todo = f"{len(missing)} of {len(manifest.generate_shards)} shards to go" if missing else "not started"
        raise EyrieError(f"run {manifest.run}: extract is not finished ({todo}).",
                         f"run `eyrie extract --run {manifest.run} --wait` first, then train.")


def plan(store, manifest: RunManifest, request: TrainSettings, cache_dir: Path) -> TrainParams:
    samples = len(done_samples(store, manifest.run))
    heldout = request.heldout_for(samples)
    if samples - heldout < 1:
        raise EyrieError(f"run {manifest.run} has {samples} extracted samples: too few to train on "
                         f"and hold {heldout} out for evaluation.",
                         "generate more samples, or pass a smaller --heldout.")
    target_vocab = _target_vocab(manifest.target.model)
    base = check_base_drafter(manifest, request, cache_dir) if request.base else None
    draft_vocab = base.draft_vocab if base else min(request.draft_vocab, target_vocab)
    return TrainParams(
        epochs=request.epochs, max_steps=request.max_steps, draft_vocab=draft_vocab,
        vocab_mapping="base" if request.base else "frequency", lr=request.lr,
        total_seq_len=request.seq_len, ttt_steps=request.ttt_steps,
        train_samples=samples - heldout, heldout_samples=heldout,
        base=base, speculators_version=version("speculators"))


def check_base_drafter(manifest: RunManifest, request: TrainSettings, cache_dir: Path) -> BaseDrafter:
    """Fetched, converted and checked against the target and the run's layers now, before any
    training is planned: a mismatch is refused here, naming both values."""
    _, info = prepare_base(request.base, request.base_revision, manifest.target.model,
                           manifest.extract.aux_layers, request.given().get("draft_vocab"), cache_dir / "base")
    return BaseDrafter(**info.model_dump(exclude={"path"}))


def _target_vocab(model: str) -> int:
    return text_config(model).vocab_size


def _check_same(params: TrainParams, request: TrainSettings) -> None:
    planned, asked = params.settings(), request.given()
    changed = [f"{name} {value} vs {planned[name]}" for name, value in asked.items()
               if name in planned and name != "draft_vocab" and value != planned[name]]
    if "draft_vocab" in asked and min(asked["draft_vocab"], params.draft_vocab) != params.draft_vocab:
        changed.append(f"draft_vocab {asked['draft_vocab']} vs {params.draft_vocab}")
    if changed:
        raise EyrieError(f"train of this run was planned with other settings: {'; '.join(changed)}.",
                         "rerun with the original settings to continue it, or start a new run.")


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
        layers = resolve_aux_layers(config.extract.layers, text_config(config.target.model).num_hidden_layers)
        return prepare_base(train.base, train.base_revision, config.target.model, layers,
                            train.given().get("draft_vocab"), Path(self.settings.cache_dir) / "base")


def run_fetch_task(payload: dict) -> dict:
    """RQ entry point (train queue)."""
    return execute(FetchBase, payload)
