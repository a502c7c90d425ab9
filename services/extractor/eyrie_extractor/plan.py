"""Plan (or continue) the extract stage of a run: check the layers, the storage mode
(extract.storage, eyrie.core.storage) and the storage budget before any forward pass, record the plan
in the run manifest, enqueue one task per shard. Run by its planning task on the extractor's
workers (`PlanExtract`: the tokenizer and the target's config are theirs), however it is started;
eyrie.stages.start_checks is what the edge (the CLI, the API) checks at once."""

from __future__ import annotations

import orjson

from eyrie.core.budget import check_fits, human, parse_size, projected_bytes
from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.provenance import RUN_CONFIG, as_used
from eyrie.core.stage_settings import ExtractSettings
from eyrie.core.storage import resolve_mode, shard_allowance
from eyrie.core.target import load_tokenizer, text_config
from eyrie.data.manifest import ExtractParams, Layout, RunManifest, ShardManifest
from eyrie.stages import EXTRACT, PLAN_EXTRACT
from eyrie.stages.extract import Extract
from eyrie.stages.start_checks import check_extract
from eyrie.tasks.executor import execute
from eyrie.tasks.planner import PlannerTask
from eyrie.work import progress
from eyrie.work.queue import enqueue
from eyrie_extractor.render import fit, render


def generated_records(store, manifest: RunManifest, shard: int) -> list[dict]:
    """The done records of one generate shard, checksum-verified."""
    layout = Layout(manifest.run)
    shard_manifest = ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(shard)))
    raw = store.get_verified(shard_manifest.object, shard_manifest.sha256)
    return [r for r in map(orjson.loads, raw.splitlines()) if r["status"] == "done"]


def target_shape(model: str, trust_remote_code: bool) -> tuple[int, int]:
    config = text_config(model, trust_remote_code)
    return config.num_hidden_layers, config.hidden_size


def plan_extract(conn, store, run: str, request: ExtractSettings,
                 given_by: str = RUN_CONFIG) -> tuple[RunManifest, int]:
    """Plan the stage from `request` (or check what it asks against the plan); enqueue what is missing.
    `given_by`: who gave `request` (recorded with each setting, eyrie.core.provenance)."""
    manifest, layout = check_extract(store, run, request), Layout(run)
    if manifest.extract is None:
        manifest.extract = _plan(store, manifest, request)
        manifest.settings[Extract.own_section()] = as_used(request, given_by)
        store.put_json(layout.manifest, manifest.model_dump())
        progress.reset(conn, run, EXTRACT.name)
    enqueued = sum(
        enqueue(conn, EXTRACT, {"run": run, "shard": p.index}, p.index)
        for p in manifest.generate_shards if not store.exists(layout.extract_shard_manifest(p.index)))
    return manifest, enqueued


def _plan(store, manifest, request: ExtractSettings) -> ExtractParams:
    target = manifest.target
    num_layers, hidden = target_shape(target.model, target.trust_remote_code)
    aux = resolve_aux_layers(request.layers, num_layers)
    max_length, dtype = request.max_length, request.dtype
    tokenizer = load_tokenizer(target.model, target.trust_remote_code)
    think = (manifest.generate.think_start, manifest.generate.think_end)
    samples = tokens = truncated = 0
    for plan in manifest.generate_shards:
        for record in generated_records(store, manifest, plan.index):
            rendered, note = fit(render(record, tokenizer, think), max_length)
            if rendered is not None:
                samples, tokens = samples + 1, tokens + len(rendered.input_ids)
                truncated += note == "truncated"
    budget_bytes = parse_size(request.budget) if request.budget else None
    need = projected_bytes(tokens, samples, len(aux) + 1, hidden, dtype)
    mode = resolve_mode(request.storage, need, budget_bytes)
    check_storage_mode(mode, request, aux, num_layers, need, budget_bytes)
    if mode == "offline":  # hybrid keeps to the budget by itself; online stores token ids alone
        check_fits(tokens, samples, len(aux) + 1, hidden, dtype, budget_bytes, store.free_bytes())
    return ExtractParams(backend=request.backend, aux_layers=aux, dtype=dtype, max_length=max_length,
                         num_layers=num_layers, hidden_size=hidden, samples=samples, tokens=tokens,
                         truncated=truncated, projected_bytes=need, budget_bytes=budget_bytes, storage=mode,
                         shard_allowance_bytes=shard_allowance(mode, budget_bytes, len(manifest.generate_shards)))


def check_storage_mode(mode: str, request: ExtractSettings, aux: list[int], num_layers: int,
                       need: int, budget_bytes: int | None) -> None:
    """hybrid and online need the vLLM extraction service during training (speculators asks it
    for the missing states): the vLLM backend, and layers the service writes in eyrie's order."""
    if mode == "offline":
        return
    chose = "" if request.storage == mode else (
        f" (extract.storage auto chose it: the hidden states need {human(need)}, extract.budget is "
        f"{human(budget_bytes)})")
    if request.backend != "vllm":
        raise EyrieError(f"extract.storage {mode}{chose} has the vLLM extraction service make hidden states "
                         "during training, and extract.backend is hf.",
                         "set extract.backend: vllm (docs/vllm-extraction.md), or extract.storage: offline.")
    if sorted(set(aux) | {num_layers}) != [*aux, num_layers]:
        raise EyrieError(f"extract.storage {mode}{chose}: the extraction service writes its layers in forward "
                         f"order with the last one ({num_layers}) at the end, and training reads them as "
                         f"written; extract.layers {aux} are in another order.",
                         f"list extract.layers ascending and below {num_layers}, "
                         f"e.g. {sorted(set(aux) - {num_layers})}.")


class PlanExtract(PlannerTask):
    """The extract stage planned (storage checked first) from the settings given where it was
    started alone, else from the run config; its missing shards enqueued. A refusal (the storage
    budget, other settings) blocks the run until the user starts it again (eyrie.tasks.planner)."""

    stage, Request = PLAN_EXTRACT, ExtractSettings

    def plan(self, request: ExtractSettings) -> dict:
        manifest, enqueued = plan_extract(self.conn, self.store, self.run_name, request, self.given_by())
        return {"samples": manifest.extract.samples, "enqueued": enqueued}


def run_plan_extract_task(payload: dict) -> dict:
    """RQ entry point (extract queue)."""
    return execute(PlanExtract, payload)
