"""Start (or continue) the extract stage of a run: check the layers and the storage budget
before any forward pass, record the plan in the run manifest, enqueue one task per shard. A
pipeline's extract stage is planned here too, by the extractor's workers (`PlanExtract`: the
tokenizer and the target's config are theirs)."""

from __future__ import annotations

import orjson

from eyrie import pipeline, progress
from eyrie.errors import EyrieError
from eyrie.executor import StageTask, execute
from eyrie.manifest import ExtractParams, Layout, RunManifest, ShardManifest, load_run_manifest
from eyrie.queue import enqueue
from eyrie.stage_settings import ExtractSettings
from eyrie.stages import EXTRACT, PLAN_EXTRACT
from eyrie.target import text_config
from eyrie.budget import check_fits, parse_size
from eyrie.layers import resolve_aux_layers
from eyrie_extractor.render import fit, render


def generated_records(store, manifest: RunManifest, shard: int) -> list[dict]:
    """The done records of one generate shard, checksum-verified."""
    layout = Layout(manifest.run)
    shard_manifest = ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(shard)))
    raw = store.get_verified(shard_manifest.object, shard_manifest.sha256)
    return [r for r in map(orjson.loads, raw.splitlines()) if r["status"] == "done"]


def target_shape(model: str) -> tuple[int, int]:
    config = text_config(model)
    return config.num_hidden_layers, config.hidden_size


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def start_extract(conn, store, run: str, request: ExtractSettings) -> tuple[RunManifest, int]:
    """Plan the stage from `request` (or check what it asks against the plan); enqueue what is missing."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    missing = [p.index for p in manifest.generate_shards
               if not store.exists(layout.generate_shard_manifest(p.index))]
    if missing:
        raise EyrieError(f"run {run}: generate is not finished ({len(missing)} of "
                         f"{len(manifest.generate_shards)} shards to go).",
                         f"wait for it (`eyrie status {run}`), then run extract again.")
    if manifest.extract is None:
        manifest.extract = _plan(store, manifest, request)
        store.put_json(layout.manifest, manifest.model_dump())
        progress.reset(conn, run, EXTRACT.name)
    else:
        _check_same(manifest.extract, request)
    enqueued = sum(
        enqueue(conn, EXTRACT, {"run": run, "shard": p.index}, p.index)
        for p in manifest.generate_shards if not store.exists(layout.extract_shard_manifest(p.index)))
    return manifest, enqueued


def _plan(store, manifest, request: ExtractSettings) -> ExtractParams:
    num_layers, hidden = target_shape(manifest.target.model)
    aux = resolve_aux_layers(request.layers, num_layers)
    max_length, dtype = request.max_length, request.dtype
    tokenizer = load_tokenizer(manifest.target.model)
    think = (manifest.generate.think_start, manifest.generate.think_end)
    samples = tokens = truncated = 0
    for plan in manifest.generate_shards:
        for record in generated_records(store, manifest, plan.index):
            rendered, note = fit(render(record, tokenizer, think), max_length)
            if rendered is not None:
                samples, tokens = samples + 1, tokens + len(rendered.input_ids)
                truncated += note == "truncated"
    budget_bytes = parse_size(request.budget) if request.budget else None
    need = check_fits(tokens, samples, len(aux) + 1, hidden, dtype, budget_bytes, store.free_bytes())
    return ExtractParams(backend=request.backend, aux_layers=aux, dtype=dtype, max_length=max_length,
                         num_layers=num_layers, hidden_size=hidden, samples=samples, tokens=tokens,
                         truncated=truncated, projected_bytes=need, budget_bytes=budget_bytes)


def _check_same(params: ExtractParams, request: ExtractSettings) -> None:
    """What a rerun asks (not its defaults) must be what was planned."""
    planned = {"layers": params.aux_layers, "max_length": params.max_length, "dtype": params.dtype}
    changed = [f"{name} {value} vs {planned[name]}" for name, value in request.given().items()
               if name in planned and value != planned[name]]
    if changed:
        raise EyrieError(f"extract of this run was planned with other settings: {'; '.join(changed)}.",
                         "rerun with the original settings to continue it, or start a new run.")


class PlanExtract(StageTask):
    """A pipeline's extract stage planned (storage checked first) from its run config, its
    missing shards enqueued; a refusal (the storage budget, other settings) blocks the run until
    the user's `eyrie run`. No done-check: a plan made already is checked and its missing shards
    enqueued again."""

    stage = PLAN_EXTRACT

    def run(self) -> dict:
        run = self.run_name
        try:
            manifest, enqueued = start_extract(self.conn, self.store, run, pipeline.stored_config(self.store, run).extract)
        except EyrieError as exc:
            pipeline.block(self.conn, run, exc)
            return {"run": run, "status": "refused", "error": str(exc)}
        return {"run": run, "samples": manifest.extract.samples, "enqueued": enqueued}


def run_plan_extract_task(payload: dict) -> dict:
    """RQ entry point (extract queue)."""
    return execute(PlanExtract, payload)
