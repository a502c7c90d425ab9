"""What starting a stage would refuse, checked at once where it is started (the CLI, the API, a
worker's `advance`) and again by its planner: reads of the run manifest and the dataset's first
rows, nothing written and no service package needed (the API's image has none)."""

from __future__ import annotations

from collections import Counter

from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import DatasetSection, ExtractSettings, GenerateSettings, TrainSettings
from eyrie.core.storage import resolve_mode
from eyrie.data import dataset
from eyrie.data.manifest import ExtractParams, Layout, RunManifest, SamplingParams, TrainParams, load_run_manifest
from eyrie.data.prompts import ROW_FIX, Skip, to_prompt


def check_generate(store, run: str, request: GenerateSettings | None, source: DatasetSection) -> None:
    """A new run's dataset is reachable and has a usable row; a planned run's is the one it
    planned, with the same sampling. The full read and the shard plan run in the planning task."""
    if store.exists(Layout(run).manifest):
        same_generate(load_run_manifest(store, run), source, request or GenerateSettings())
    else:
        usable_row(dataset.resolve(source.source, source.split, source.revision, source.limit))


def usable_row(ref) -> None:
    """Refuse a dataset without one usable row (nothing would be generated). Reads up to the first
    usable row: one row for a normal dataset, every row of a broken one."""
    reasons: Counter = Counter()
    for _, data, problem in dataset.iter_rows(ref):
        prompt = None if problem else to_prompt(data)
        if not problem and not isinstance(prompt, Skip):
            return
        reasons[problem or prompt.reason] += 1
    top = ", ".join(f"{reason} x{n}" for reason, n in reasons.most_common(3))
    raise EyrieError(f"dataset {ref.source}: none of the {reasons.total()} rows read is a usable prompt ({top}).",
                     ROW_FIX)


def same_generate(manifest: RunManifest, source: DatasetSection, request: GenerateSettings) -> None:
    """A rerun continues the run; it may not silently change what the run is."""
    ref = manifest.dataset
    wanted = dataset.resolve(source.source, ref.split, None, source.limit)
    problems = []
    if wanted.revision != ref.revision:  # by content: the same file at another path is the same dataset
        problems.append(f"dataset {wanted.source}@{wanted.revision[:12]} vs {ref.source}@{ref.revision[:12]}")
    if source.limit is not None and wanted.row_end != ref.row_end:
        problems.append(f"rows {wanted.row_end} vs {ref.row_end}")
    sampling = manifest.generate.sampling
    for name, value in request.given().items():
        if name in SamplingParams.model_fields and value != getattr(sampling, name):
            problems.append(f"{name} {value} vs {getattr(sampling, name)}")
    if "turns" in request.given() and request.turns != manifest.generate.turns:
        problems.append(f"turns {request.turns} vs {manifest.generate.turns}")
    if problems:
        raise EyrieError(f"run {manifest.run} already exists with other settings: {'; '.join(problems)}.",
                         "rerun with the original settings to continue it, or choose a new --run name.")


def check_extract(store, run: str, request: ExtractSettings, dataset=None) -> RunManifest:
    """Generate is finished, and a planned extract was planned with what `request` asks."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    missing = [p.index for p in manifest.generate_shards
               if not store.exists(layout.generate_shard_manifest(p.index))]
    if missing:
        raise EyrieError(f"run {run}: generate is not finished ({len(missing)} of "
                         f"{len(manifest.generate_shards)} shards to go).",
                         f"wait for it (`eyrie status {run}`), then run extract again.")
    if manifest.extract is not None:
        same_extract(manifest.extract, request)
    return manifest


def same_extract(params: ExtractParams, request: ExtractSettings) -> None:
    """What a rerun asks (not its defaults) must be what was planned."""
    planned = {"layers": params.aux_layers, "max_length": params.max_length, "dtype": params.dtype,
               "storage": params.storage}
    asked = request.given()
    if "storage" in asked:  # `auto` asks what it chose then (the same projection and budget)
        asked["storage"] = resolve_mode(asked["storage"], params.projected_bytes, params.budget_bytes)
    changed = [f"{name} {value} vs {planned[name]}" for name, value in asked.items()
               if name in planned and value != planned[name]]
    if changed:
        raise EyrieError(f"extract of this run was planned with other settings: {'; '.join(changed)}.",
                         "rerun with the original settings to continue it, or start a new run.")


def check_train(store, run: str, request: TrainSettings, dataset=None) -> RunManifest:
    """Extract is finished, and a planned train was planned with what `request` asks."""
    manifest = load_run_manifest(store, run)
    extract_done(store, manifest)
    if manifest.train is not None:
        same_train(manifest.train, request, run)
    return manifest


def extract_done(store, manifest: RunManifest) -> None:
    layout = Layout(manifest.run)
    missing = [] if manifest.extract is None else [
        p.index for p in manifest.generate_shards if not store.exists(layout.extract_shard_manifest(p.index))]
    if manifest.extract is None or missing:
        todo = f"{len(missing)} of {len(manifest.generate_shards)} shards to go" if missing else "not started"
        raise EyrieError(f"run {manifest.run}: extract is not finished ({todo}).",
                         f"run `eyrie extract --run {manifest.run} --wait` first, then train.")


def same_train(params: TrainParams, request: TrainSettings, run: str = "RUN") -> None:
    """What a rerun asks must be what was planned (a smaller draft vocabulary than planned too)."""
    planned, asked = params.settings(), request.given()
    changed = [name for name, value in asked.items()
               if name in planned and name != "draft_vocab" and value != planned[name]]
    if "draft_vocab" in asked and min(asked["draft_vocab"], params.draft_vocab) != params.draft_vocab:
        changed.append("draft_vocab")
    if changed:
        flags = " ".join(f"--{name.replace('_', '-')} {asked[name]}" for name in changed)
        raise EyrieError(f"train of run {run} was planned with other settings: "
                         f"{'; '.join(f'{name} {asked[name]} vs {planned[name]}' for name in changed)}.",
                         f"train a new run on this run's hidden states with them: `eyrie train --run {run} --as "
                         f"NEW_RUN {flags}` (or `eyrie run --config` with a new run name and the same target, "
                         "dataset, generate and extract: it starts at train); rerun with the original "
                         "settings to continue this one.")
