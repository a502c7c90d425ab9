"""`eyrie run --plan`: what a pipeline will cost, from its config alone (no server, no GPU, no
dataset download): bytes (the bucket, the trainer's local copy, against free space or the budget),
hours (generation, extraction, training), the lengths each stage keeps, whether the pinned vLLM
supports the target (eyrie/core/support.py), and the GPUs; what cannot work is refused before any GPU
work (eyrie/runs/plan_checks.py). The result is a `Plan` (eyrie/runs/plan_result.py), printed by
eyrie/runs/plan_lines.py. docs/planning.md walks through the seed's case."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from eyrie.core.budget import parse_size, projected_bytes
from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.provenance import RUN_CONFIG, as_used
from eyrie.core.recipe import pack_length, trainer_device
from eyrie.core.run_config import RunConfigBase
from eyrie.core.stage_settings import pacing_fields
from eyrie.core.support import architecture, check
from eyrie.core.target import refuse_remote_code, text_config
from eyrie.data.manifest import DatasetRef, Layout, ShardManifest, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.plan_checks import gpu_plan, on_demand_quota, over_budget, refuse, storage_refusal, unknown_mean
from eyrie.runs.plan_inputs import dataset_rows, estimated_mean, published_answers, requests
from eyrie.runs.plan_result import DOWNLOAD, Lengths, Plan, TrainRecipe
from eyrie.runs.plan_space import space
from eyrie.runs.reuse import states_to_reuse
from eyrie.runs.storage_plan import storage_plan, target_weights
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train

RECORD_BYTES_PER_TOKEN = 4  # a generated JSONL record: text + token ids, about 4 bytes a token
DTYPES = ("bf16", "fp8")

# Measured throughputs, keyed by the target's (hidden size, layers): used where the run config
# gives none. Sources: the field notes (one H200) and the seed (8 GPUs over PCIe).
EXTRACT_FIGURES = {
    (4096, 32): (15_800, "HF forward + safetensors write, Llama-3-8B shape, one H200 (bench/extract_throughput.py)"),
    (2048, 16): (41_600, "HF forward + safetensors write, Llama-1B shape, one H200 (bench/extract_throughput.py)"),
    (7168, 61): (2_912, "the seed: Kimi-K2.5 INT4 on 8 GPUs, 1,000 samples"),
}
TRAIN_FIGURES = {
    (4096, 32): (30_700, "speculators sdpa + eager loss, 8B shape, 8192 tokens a step, one H200"),
}


def target_shape(config: RunConfigBase) -> tuple[int, int, int, str, str | None]:
    """(hidden, layers, vocab, where from, architecture): the target's config if this host can
    read it (local directory or HF cache), else the shape written in the run config."""
    refuse_remote_code(config.target.model, config.serve.trust_remote_code)
    try:
        c = text_config(config.target.model, config.serve.trust_remote_code)
        return c.hidden_size, c.num_hidden_layers, c.vocab_size, "the target's config", architecture(config)
    except EyrieError:
        shape = config.target.shape
        if shape is None:
            raise EyrieError(f"cannot read the config of {config.target.model} here (no hub access or cache).",
                             "add target.shape (hidden_size, num_hidden_layers, vocab_size) to the run config, "
                             "or run --plan where the model is available.") from None
        return (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size, "target.shape in the run config",
                shape.architecture)


def project(config: RunConfigBase, settings, measure: bool = True) -> Plan:
    """The plan; `measure` False: nothing read from the store or the disks (a run's start)."""
    device = trainer_device(settings.device)
    p = sized(config, settings, device, measure)
    p.target_weights_bytes, p.target_weights_from = target_weights(config, p)
    p.serve_deadline_s = settings.serve_deadline_s
    p.target_download_bytes = 0 if Path(config.target.model).is_dir() else p.target_weights_bytes
    if measure:
        p.generate_measured = measured_generation(config, settings)
        p.states_from = reused_from(config, settings)
        p.answers_from = published_answers(config)
    p.decided_elsewhere = decided_on_generator(config, settings)
    p.train_recipe = train_recipe(config, p, device)
    p.hours = hours(config, p)
    p.support = check(p.architecture, config.extract.backend)
    p.gpus = gpu_plan(config, settings)
    p.storage = storage_plan(config, p)
    p.fits, p.fits_expected = chosen_fits(p)
    p.space = space(config, settings, p) if measure else None
    checks = (unknown_mean(p), over_budget(p), storage_refusal(p), on_demand_quota(p, settings))
    p.refusals = [r for r in checks if r] + p.gpus.refusals
    return p


def sized(config: RunConfigBase, settings, device: str, measure: bool) -> Plan:
    """The plan's first fields: the target's shape, the samples and their lengths, the bytes."""
    hidden, num_layers, vocab, shape_from, arch = target_shape(config)
    aux = resolve_aux_layers(config.extract.layers, num_layers)
    n, dataset = dataset_rows(config, missing_ok=not measure)
    generate = config.generate.with_host_defaults(settings.generate_defaults())
    prompt, max_tokens = config.generate.prompt_tokens_estimate, generate.max_tokens
    mean, mean_from = mean_tokens(config, dataset, max_tokens)
    length = lengths(config, n, prompt + max_tokens, device)
    stored = None if mean is None else min(mean, length.extract_max_length)  # extraction cuts at max_length
    sizes = hidden_state_bytes(config, n, n * (prompt + max_tokens), len(aux) + 1, hidden, stored)
    return Plan(run=config.run, target=config.target.model, shape_from=shape_from, hidden_size=hidden,
                num_layers=num_layers, vocab_size=vocab, architecture=arch, aux_layers=aux, samples=n,
                max_tokens=max_tokens, concurrency=generate.concurrency, prompt_tokens_estimate=prompt,
                mean_tokens=mean, mean_tokens_from=mean_from, stored_mean_tokens=stored,
                tokens_upper_bound=n * (prompt + max_tokens), dataset_from=rows_from(config, dataset),
                requests=requests(n, dataset, generate.turns), records_bytes=n * max_tokens * RECORD_BYTES_PER_TOKEN,
                dtype=config.extract.dtype, lengths=length, **sizes)


def mean_tokens(config: RunConfigBase, dataset: DatasetRef | None, max_tokens: int) -> tuple[int | None, str | None]:
    """The mean sample length and where it is from: plan.mean_tokens, else the rows' own lengths
    where the dataset is here, else unknown."""
    if config.plan.mean_tokens is not None:
        return config.plan.mean_tokens, "plan.mean_tokens"
    return (dataset and estimated_mean(config, dataset, max_tokens)) or (None, None)


def rows_from(config: RunConfigBase, dataset: DatasetRef | None) -> str:
    if dataset:
        return f"the rows of {dataset.source}"
    return f"dataset.limit of the hub dataset {config.dataset.source}, which --plan does not download"


def hidden_state_bytes(config: RunConfigBase, n: int, tokens: int, states: int, hidden: int, stored: int | None) -> dict:
    """Plan's byte fields: every state at the upper bound and per 1,000 tokens (by dtype), at the
    stored mean where known, and whether they fit extract.budget."""
    sizes = {dtype: projected_bytes(tokens, n, states, hidden, dtype) for dtype in DTYPES}
    budget = parse_size(config.extract.budget) if config.extract.budget else None
    per_1k = {dtype: projected_bytes(1000 * n, n, states, hidden, dtype) for dtype in DTYPES}
    expected = None if stored is None else projected_bytes(n * stored, n, states, hidden, config.extract.dtype)
    return {"per_1k_tokens_per_sample": per_1k, "hidden_states_bytes": sizes, "hidden_states_bytes_expected": expected,
            "budget_bytes": budget, "all_states_fit": None if budget is None else sizes[config.extract.dtype] <= budget,
            "all_states_fit_expected": None if budget is None or expected is None else expected <= budget}


def chosen_fits(p: Plan) -> tuple[bool | None, bool | None]:
    """The top-level answer is the mode the run takes: `fits`, its bytes within extract.budget (at
    the expected mean where known, else the upper bound); `fits_expected`, at the expected mean."""
    s = p.storage
    if p.budget_bytes is None:
        return None, None
    fits = s.chosen is not None and s.modes[s.chosen].fits
    return fits, None if p.hidden_states_bytes_expected is None else fits


def refuse_before_start(config: RunConfigBase, settings) -> None:
    """`eyrie run` and POST /runs, before anything is written: whatever `eyrie run --plan` refuses,
    with the same message (the same plan, the same refusals: vLLM support, expected bytes over
    extract.budget or a budget no known mean can check, a storage mode the extract stage would
    refuse, the GPUs; and a plan that cannot be made, such as a target whose shape is unknown here)."""
    refuse(project(config, settings))


def measured_generation(config: RunConfigBase, settings) -> tuple[float, str] | None:
    """The server's output tok/s as this run measured it so far (its finished generate shards:
    completion tokens / first start to last finish), where the store has the run."""
    store, layout = open_store(settings), Layout(config.run)
    if not store.exists(layout.manifest):
        return None
    shards = [ShardManifest.model_validate(store.get_json(layout.generate_shard_manifest(s.index)))
              for s in load_run_manifest(store, config.run).generate_shards
              if store.exists(layout.generate_shard_manifest(s.index))]
    if not shards:
        return None
    tokens = sum(s.counts.completion_tokens for s in shards)
    start = min(datetime.fromisoformat(s.started_at) for s in shards)
    wall = (max(datetime.fromisoformat(s.finished_at) for s in shards) - start).total_seconds()
    if wall <= 0 or tokens == 0:
        return None
    return tokens / wall, f"measured: this run's {len(shards)} generated shard(s)"


def lengths(config: RunConfigBase, n: int, longest: int, device: str = "cpu") -> Lengths:
    """Training must see what extraction stored: the tokens past train.seq_len are stored, then cut."""
    extract_len = min(config.extract.max_length or longest, longest)
    train_len = pack_length(config.train.seq_len, device)
    unseen = n * max(0, extract_len - train_len)
    return Lengths(extract_max_length=extract_len, train_seq_len=train_len, unseen_tokens_upper_bound=unseen)


def hours(config: RunConfigBase, p: Plan) -> dict:
    """Each stage's hours: tokens / tok/s (given in plan:, else our measured figure for the shape)."""
    stages = {**stage_hours(config, p), **not_run(p)}
    stages[DOWNLOAD] = download_hours(config, p.target_download_bytes)
    known = [s["hours"] for s in stages.values()]
    return {**stages, "basis": "upper bound" if p.mean_tokens is None else "expected mean",
            "total": None if None in known else round(sum(known), 2)}


def stage_hours(config: RunConfigBase, p: Plan) -> dict:
    """Generate's, extract's and train's tokens at their rate (generate's: the run's own once it has generated)."""
    n, shape = p.samples, (p.hidden_size, p.num_layers)
    mean = p.mean_tokens or p.prompt_tokens_estimate + p.max_tokens
    completion = n * max(1, mean - p.prompt_tokens_estimate)
    stored = n * min(mean, p.lengths.extract_max_length)
    epochs = p.train_recipe.epochs
    trained = n * min(mean, p.lengths.train_seq_len) * epochs
    measured = p.generate_measured  # once the run has generated, its own rate beats a guess
    stages = {Generate.name: _stage(completion, None if measured else config.plan.generate_tokens_per_s, measured,
                                    "plan.generate_tokens_per_s"),
              Extract.name: _stage(stored, config.plan.extract_tokens_per_s, EXTRACT_FIGURES.get(shape),
                                   "plan.extract_tokens_per_s"),
              Train.name: _stage(trained, config.plan.train_tokens_per_s, TRAIN_FIGURES.get(shape),
                                 "plan.train_tokens_per_s")}
    stages[Train.name]["epochs"] = epochs
    return stages


def not_run(p: Plan) -> dict:
    """The stages a run on earlier states (eyrie.runs.reuse) or on published answers
    (eyrie.runs.from_answers) does not run: none of their tokens, no hours."""
    skipped = {}
    if p.states_from:
        for name in (Generate.name, Extract.name):
            skipped[name] = {"tokens": 0, "tokens_per_s": None, "hours": 0, "source": f"run {p.states_from}'s, reused"}
    if p.answers_from:
        skipped[Generate.name] = {"tokens": 0, "tokens_per_s": None, "hours": 0,
                                  "source": f"the answers in {p.answers_from}"}
    return skipped


def reused_from(config: RunConfigBase, settings) -> str | None:
    """The earlier run whose answers and states this one would train on (same target, dataset,
    generate and extract settings), where the store answers; None where it does not."""
    try:
        used = as_used(config.generate, RUN_CONFIG, settings.generate_defaults())  # as this host would resolve them
        earlier = states_to_reuse(open_store(settings), config, used)
    except Exception:  # noqa: BLE001 -- --plan runs without a store too; the run's start decides for real
        return None
    return earlier.run if earlier else None


def decided_on_generator(config: RunConfigBase, settings) -> dict:
    """The generate settings the run config does not give: the generator host's planner decides them
    (its EYRIE_<FIELD>, else the default); --plan shows what this host would use."""
    used = as_used(config.generate, RUN_CONFIG, settings.generate_defaults())
    pacing = pacing_fields(type(config.generate))
    return {name: entry for name, entry in used.items() if entry["source"] != RUN_CONFIG and name not in pacing}


def train_recipe(config: RunConfigBase, p: Plan, device: str) -> TrainRecipe:
    """The recipe the trainer will choose (eyrie.core.recipe), from the expected training tokens
    (the mean where known, else the upper bound) where training runs (EYRIE_DEVICE, or this host's)."""
    n, mean = p.samples, p.mean_tokens or p.prompt_tokens_estimate + p.max_tokens
    train = max(1, n - config.train.heldout_for(n))
    recipe = config.train.recipe(train * min(mean, p.lengths.train_seq_len), device)
    return TrainRecipe(epochs=recipe.epochs, steps=recipe.steps, lr=recipe.lr, warmup=recipe.warmup,
                       schedule=recipe.schedule, seq_len=recipe.seq_len, device=device, statement=recipe.statement())


def download_hours(config: RunConfigBase, size: int) -> dict:
    """The target's weights from the hub, before the server answers (none for a local directory)."""
    rate = parse_size(config.plan.download_per_s) if config.plan.download_per_s else None
    source = "given in the run config" if rate else "unknown: set plan.download_per_s"
    return {"bytes": size, "bytes_per_s": rate, "source": "a local directory" if not size else source,
            "hours": 0 if not size else round(size / rate / 3600, 2) if rate else None}


def _stage(tokens: int, given: float | None, figure: tuple | None, knob: str) -> dict:
    rate, source = (given, "given in the run config") if given else (figure or (None, None))
    return {"tokens": tokens, "tokens_per_s": rate, "source": source or f"unknown: set {knob}",
            "hours": None if not rate else round(tokens / rate / 3600, 2)}
