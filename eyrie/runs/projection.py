"""`eyrie run --plan`: what a pipeline will cost, from its config alone (no server, no GPU, no
dataset download): bytes (the bucket, the trainer's local copy, against free space or the budget),
hours (generation, extraction, training), the lengths each stage keeps, whether the pinned vLLM
supports the target (eyrie/core/support.py), and the GPUs; what cannot work is refused before any GPU
work (eyrie/runs/plan_checks.py). docs/planning.md walks through the seed's case."""

from __future__ import annotations

import math
import shutil
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse

from eyrie.core.budget import human, parse_size, projected_bytes
from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.recipe import pack_length, trainer_device
from eyrie.core.run_config import RunConfig
from eyrie.core.support import architecture, check
from eyrie.core.target import refuse_remote_code, text_config
from eyrie.data.manifest import Layout, ShardManifest, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.plan_checks import (budget_verdict, gpu_lines, gpu_plan, on_demand_quota, over_budget, refuse,
                                   storage_refusal, unknown_mean)
from eyrie.runs.plan_inputs import dataset_rows, estimated_mean, published_answers, requests
from eyrie.runs.reuse import states_to_reuse
from eyrie.runs.storage_plan import sharing_lines, storage_lines, storage_plan, target_weights
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train
from eyrie.work.disk import reported

DOWNLOAD = "download"  # the hours' first row: the target's weights from the hub
RECORD_BYTES_PER_TOKEN = 4  # a generated JSONL record: text + token ids, about 4 bytes a token

# Measured throughputs, keyed by the target's (hidden size, layers): used where the run config
# gives none. Sources: /work/shared/FIELD-NOTES.md (one H200) and the seed (8 GPUs over PCIe).
EXTRACT_FIGURES = {
    (4096, 32): (15_800, "HF forward + safetensors write, Llama-3-8B shape, one H200 (bench/extract_throughput.py)"),
    (2048, 16): (41_600, "HF forward + safetensors write, Llama-1B shape, one H200 (bench/extract_throughput.py)"),
    (7168, 61): (2_912, "the seed: Kimi-K2.5 INT4 on 8 GPUs, 1,000 samples"),
}
TRAIN_FIGURES = {
    (4096, 32): (30_700, "speculators sdpa + eager loss, 8B shape, 8192 tokens a step, one H200"),
}


def target_shape(config: RunConfig) -> tuple[int, int, int, str, str | None]:
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


def project(config: RunConfig, settings, measure: bool = True) -> dict:
    """The plan; `measure` False: nothing read from the store or the disks (a run's start)."""
    hidden, num_layers, vocab, shape_from, architecture = target_shape(config)
    aux = resolve_aux_layers(config.extract.layers, num_layers)
    n, dataset = dataset_rows(config, missing_ok=not measure)
    generate = config.generate.with_host_defaults(settings.generate_defaults())
    max_tokens = generate.max_tokens
    prompt = config.generate.prompt_tokens_estimate
    tokens = n * (prompt + max_tokens)
    mean, mean_from = config.plan.mean_tokens, "plan.mean_tokens"
    if mean is None:  # the rows' own lengths, where the dataset is here
        mean, mean_from = (dataset and estimated_mean(config, dataset, max_tokens)) or (None, None)
    rows_from = f"the rows of {dataset.source}" if dataset else \
        f"dataset.limit of the hub dataset {config.dataset.source}, which --plan does not download"
    states = len(aux) + 1
    sizes = {dtype: projected_bytes(tokens, n, states, hidden, dtype) for dtype in ("bf16", "fp8")}
    budget = parse_size(config.extract.budget) if config.extract.budget else None
    every = sizes[config.extract.dtype]
    per_1k = {dtype: projected_bytes(1000 * n, n, states, hidden, dtype) for dtype in ("bf16", "fp8")}
    device = trainer_device(settings.device)
    length = lengths(config, n, prompt + max_tokens, device)
    stored = None if mean is None else min(mean, length["extract_max_length"])  # extraction cuts at max_length
    expected = None if stored is None else projected_bytes(n * stored, n, states, hidden, config.extract.dtype)
    p = {"per_1k_tokens_per_sample": per_1k, "run": config.run, "target": config.target.model,
         "shape_from": shape_from, "hidden_size": hidden, "num_layers": num_layers, "vocab_size": vocab,
         "architecture": architecture, "aux_layers": aux, "samples": n, "max_tokens": max_tokens,
         "concurrency": generate.concurrency, "prompt_tokens_estimate": prompt,
         "mean_tokens": mean, "mean_tokens_from": mean_from, "stored_mean_tokens": stored,
         "tokens_upper_bound": tokens, "dataset_from": rows_from, "requests": requests(n, dataset, generate.turns),
         "hidden_states_bytes": sizes, "hidden_states_bytes_expected": expected,
         "records_bytes": n * max_tokens * RECORD_BYTES_PER_TOKEN, "dtype": config.extract.dtype,
         "budget_bytes": budget, "all_states_fit": None if budget is None else every <= budget,
         "all_states_fit_expected": None if budget is None or expected is None else expected <= budget}
    weights, weights_from = target_weights(config, p)
    p.update(target_weights_bytes=weights, target_weights_from=weights_from, serve_deadline_s=settings.serve_deadline_s,
             target_download_bytes=0 if Path(config.target.model).is_dir() else weights)
    p["generate_measured"] = measured_generation(config, settings) if measure else None
    p["states_from"] = reused_from(config, settings) if measure else None
    p["answers_from"] = published_answers(config) if measure else None
    p["lengths"] = length
    p["train_recipe"] = train_recipe(config, p, device)
    p["hours"] = hours(config, p)
    p["support"] = check(architecture, config.extract.backend)
    p["gpus"] = gpu_plan(config, settings)
    p["storage"] = storage_plan(config, p)
    p.update(chosen_fits(p))
    p["space"] = space(config, settings, p) if measure else None
    checks = (unknown_mean(p), over_budget(p), storage_refusal(p), on_demand_quota(p, settings))
    p["refusals"] = [r for r in checks if r] + p["gpus"]["refusals"]
    return p


def chosen_fits(p: dict) -> dict:
    """The top-level answer is the mode the run takes: `fits`, its bytes within extract.budget (at
    the expected mean where known, else the upper bound); `fits_expected`, at the expected mean."""
    budget, s = p["budget_bytes"], p["storage"]
    if budget is None:
        return {"fits": None, "fits_expected": None}
    fits = s["chosen"] is not None and s["modes"][s["chosen"]]["fits"]
    return {"fits": fits, "fits_expected": None if p["hidden_states_bytes_expected"] is None else fits}


def refuse_before_start(config: RunConfig, settings) -> None:
    """`eyrie run` and POST /runs, before anything is written: whatever `eyrie run --plan` refuses,
    with the same message (the same plan, the same refusals: vLLM support, expected bytes over
    extract.budget or a budget no known mean can check, a storage mode the extract stage would
    refuse, the GPUs; and a plan that cannot be made, such as a target whose shape is unknown here)."""
    refuse(project(config, settings))


def measured_generation(config: RunConfig, settings) -> tuple[float, str] | None:
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


def lengths(config: RunConfig, n: int, longest: int, device: str = "cpu") -> dict:
    """Training must see what extraction stored: the tokens past train.seq_len are stored, then cut."""
    extract_len = min(config.extract.max_length or longest, longest)
    train_len = pack_length(config.train.seq_len, device)
    unseen = n * max(0, extract_len - train_len)
    return {"extract_max_length": extract_len, "train_seq_len": train_len, "unseen_tokens_upper_bound": unseen}


def space(config: RunConfig, settings, p: dict) -> dict:
    """Bucket + the trainer's local copy of the hidden states (as the storage mode keeps them:
    offline all, hybrid what the budget holds, online none), against the free space where they
    go: the bucket's directory where this host sees it (plan.store_path, a file:// store), else
    what the S3 server says (MinIO's admin info), else EYRIE_DATA_DIR; the trainer's cache as the
    trainers report it to Redis (eyrie.work.disk; in the stack --plan runs in another container), or
    this host's own with a file:// store or plan.trainer_cache_path; and the configured budget."""
    mode = p["storage"]["modes"][p["storage"]["chosen"] or "offline"]
    states, bucket = mode["trainer_cache_bytes"], mode["bucket_bytes"]
    local = urlparse(settings.store_url).scheme == "file"
    bucket_dir = _existing(config.plan.store_path or _store_dir(settings.store_url))
    cache_dir = _existing(config.plan.trainer_cache_path or (settings.cache_dir if local else None))
    out = {"bucket_bytes": bucket, "trainer_copy_bytes": states, "mode": p["storage"]["chosen"] or "offline",
           "bucket_dir": bucket_dir and str(bucket_dir),
           "trainer_dir": cache_dir and str(cache_dir), "bucket_free": None, "trainer_free": None,
           "same_device": False, "basis": "upper bound" if p["hidden_states_bytes_expected"] is None else "expected mean"}
    if bucket_dir:
        out["bucket_free"] = shutil.disk_usage(bucket_dir).free
    elif (said := _s3_free(settings)) is not None:
        out["bucket_free"], out["bucket_dir"] = said, f"{settings.store_url} (the S3 server's own figure)"
    elif data_dir := _existing(settings.data_dir):
        bucket_dir, out["bucket_dir"], out["bucket_free"] = data_dir, str(data_dir), shutil.disk_usage(data_dir).free
    if cache_dir:
        out["trainer_free"] = shutil.disk_usage(cache_dir).free
    elif reports := reported(settings.redis_url, Train.queue):
        least = reports[0]  # any trainer may take the run's train task: the one with the least room
        age = max(0.0, time.time() - least["at"])
        several = f"; {len(reports)} trainers, the least free" if len(reports) > 1 else ""
        out["trainer_free"] = least["free"]
        out["trainer_dir"] = f"{least['dir']} on {least['host']} (its report, {age:.0f} s old{several})"
    if bucket_dir and cache_dir:
        out["same_device"] = bucket_dir.stat().st_dev == cache_dir.stat().st_dev
    need_one = bucket + states if out["same_device"] else bucket
    out["fits_bucket"] = None if out["bucket_free"] is None else need_one <= out["bucket_free"]
    out["fits_trainer"] = None if out["trainer_free"] is None or out["same_device"] else states <= out["trainer_free"]
    return out


def _s3_free(settings) -> int | None:
    """What the S3 server behind an s3:// store says it has free (None: it does not say)."""
    if urlparse(settings.store_url).scheme != "s3":
        return None
    try:
        return open_store(settings).free_bytes()
    except EyrieError:
        return None


def _store_dir(store_url: str) -> str | None:
    parsed = urlparse(store_url)
    return (parsed.netloc + parsed.path) if parsed.scheme == "file" else None


def _existing(path: str | None) -> Path | None:
    """The directory, or its nearest existing parent (free space is the same device's)."""
    if not path:
        return None
    try:
        current = Path(path).expanduser().resolve()
        while not current.exists() and current != current.parent:
            current = current.parent
        return current
    except (OSError, ValueError, RuntimeError):  # a path this host cannot even look at
        return None


def hours(config: RunConfig, p: dict) -> dict:
    """Each stage's hours: tokens / tok/s (given in plan:, else our measured figure for the shape)."""
    n, shape = p["samples"], (p["hidden_size"], p["num_layers"])
    mean = p["mean_tokens"] or p["prompt_tokens_estimate"] + p["max_tokens"]
    completion = n * max(1, mean - p["prompt_tokens_estimate"])
    stored = n * min(mean, p["lengths"]["extract_max_length"])
    epochs = p["train_recipe"]["epochs"]
    trained = n * min(mean, p["lengths"]["train_seq_len"]) * epochs
    measured = p.get("generate_measured")  # once the run has generated, its own rate beats a guess
    stages = {Generate.name: _stage(completion, None if measured else config.plan.generate_tokens_per_s, measured,
                                 "plan.generate_tokens_per_s"),
              Extract.name: _stage(stored, config.plan.extract_tokens_per_s, EXTRACT_FIGURES.get(shape),
                                "plan.extract_tokens_per_s"),
              Train.name: _stage(trained, config.plan.train_tokens_per_s, TRAIN_FIGURES.get(shape),
                              "plan.train_tokens_per_s")}
    stages[Train.name]["epochs"] = epochs
    if p.get("states_from"):  # nothing generated or extracted again (eyrie.runs.reuse)
        for name in (Generate.name, Extract.name):
            stages[name] = {"tokens": 0, "tokens_per_s": None, "hours": 0, "source": f"run {p['states_from']}'s, reused"}
    if p.get("answers_from"):  # nothing generated (eyrie.runs.from_answers)
        stages[Generate.name] = {"tokens": 0, "tokens_per_s": None, "hours": 0, "source": f"the answers in "
                                 f"{p['answers_from']}"}
    stages[DOWNLOAD] = download_hours(config, p["target_download_bytes"])
    known = [s["hours"] for s in stages.values()]
    return {**stages, "basis": "upper bound" if p["mean_tokens"] is None else "expected mean",
            "total": None if None in known else round(sum(known), 2)}


def reused_from(config: RunConfig, settings) -> str | None:
    """The earlier run whose answers and states this one would train on (same target, dataset,
    generate and extract settings), where the store answers; None where it does not."""
    try:
        earlier = states_to_reuse(open_store(settings), config)
    except Exception:  # noqa: BLE001 -- --plan runs without a store too; the run's start decides for real
        return None
    return earlier.run if earlier else None


def train_recipe(config: RunConfig, p: dict, device: str) -> dict:
    """The recipe the trainer will choose (eyrie.core.recipe), from the expected training tokens
    (the mean where known, else the upper bound) where training runs (EYRIE_DEVICE, or this host's)."""
    n, mean = p["samples"], p["mean_tokens"] or p["prompt_tokens_estimate"] + p["max_tokens"]
    train = max(1, n - config.train.heldout_for(n))
    recipe = config.train.recipe(train * min(mean, p["lengths"]["train_seq_len"]), device)
    return {"epochs": recipe.epochs, "steps": recipe.steps, "lr": recipe.lr, "warmup": recipe.warmup,
            "schedule": recipe.schedule, "seq_len": recipe.seq_len, "device": device, "statement": recipe.statement()}


def download_hours(config: RunConfig, size: int) -> dict:
    """The target's weights from the hub, before the server answers (none for a local directory)."""
    rate = parse_size(config.plan.download_per_s) if config.plan.download_per_s else None
    source = "given in the run config" if rate else "unknown: set plan.download_per_s"
    return {"bytes": size, "bytes_per_s": rate, "source": "a local directory" if not size else source,
            "hours": 0 if not size else round(size / rate / 3600, 2) if rate else None}


def _stage(tokens: int, given: float | None, figure: tuple | None, knob: str) -> dict:
    rate, source = (given, "given in the run config") if given else (figure or (None, None))
    return {"tokens": tokens, "tokens_per_s": rate, "source": source or f"unknown: set {knob}",
            "hours": None if not rate else round(tokens / rate / 3600, 2)}


def render(p: dict) -> list[str]:
    lines = [f"run {p['run']}: plan (no server, no GPU)",
             f"  target {p['target']}: hidden {p['hidden_size']}, {p['num_layers']} layers, vocab "
             f"{p['vocab_size']:,} (from {p['shape_from']}); architecture {p['architecture'] or 'unknown'}",
             f"  samples {p['samples']:,} ({p['dataset_from']}); {p['requests']['statement']}; at most "
             f"{p['tokens_upper_bound']:,} tokens (prompt estimate + max_tokens {p['max_tokens']:,} each)"
             + (f"; expected mean {p['mean_tokens']:,} tokens a sample ({p['mean_tokens_from']})" if p["mean_tokens"]
                else "; the mean sample length is unknown (a hub dataset: set plan.mean_tokens)"),
             f"  hidden states: layers {p['aux_layers']} + last; at most "
             f"{human(p['hidden_states_bytes']['bf16'])} in bf16, {human(p['hidden_states_bytes']['fp8'])} in fp8"
             + (f"; expected {human(p['hidden_states_bytes_expected'])} in {p['dtype']}"
                if p["hidden_states_bytes_expected"] else ""),
             f"  (each 1,000 tokens of mean sample length: {human(p['per_1k_tokens_per_sample']['bf16'])} bf16, "
             f"{human(p['per_1k_tokens_per_sample']['fp8'])} fp8)",
             f"  generated records: at most {human(p['records_bytes'])}"]
    if p["budget_bytes"] is not None:
        lines.append(f"  budget {human(p['budget_bytes'])}, {p['dtype']}: {budget_verdict(p)}")
    return (lines + _weights_lines(p) + _space_lines(p["space"]) + _length_lines(p["lengths"]) + _hour_lines(p)
            + [f"  train recipe (on {p['train_recipe']['device']}): {p['train_recipe']['statement']}"]
            + storage_lines(p)
            + _support_lines(p) + gpu_lines(p) + sharing_lines(p)
            + ["  extract checks the real projection (actual tokens) before any forward pass."])


def _space_lines(s: dict) -> list[str]:
    lines = [f"  every copy ({s['basis']}, {s['mode']}): bucket {human(s['bucket_bytes'])} (hidden states + records), "
             f"the trainer's local copy {human(s['trainer_copy_bytes'])} (on the trainer's host: "
             "EYRIE_CACHE_DIR, EYRIE_TRAINER_CACHE_DIR in the stack)"]
    if s["bucket_free"] is not None:
        both = " (the trainer's copy is on the same device: counted against it too)" if s["same_device"] else ""
        lines.append(f"  free at {s['bucket_dir']}: {human(s['bucket_free'])}{both}: "
                     + ("fits" if s["fits_bucket"] else "does NOT fit"))
    else:
        lines.append("  the bucket's free space is not visible here (the S3 server does not say it; MinIO's admin "
                     "info does): set plan.store_path (MinIO's data directory, EYRIE_DATA_DIR) or rely on "
                     "extract.budget")
    if s["trainer_free"] is not None and not s["same_device"]:
        lines.append(f"  free at {s['trainer_dir']} (trainer): {human(s['trainer_free'])}: "
                     + ("fits" if s["fits_trainer"] else "does NOT fit"))
    elif s["trainer_free"] is None:
        lines.append("  the trainer's free space is not known here: no `eyrie worker train` reports it to this Redis "
                     "(each does every 30 s); start the trainer, or set plan.trainer_cache_path")
    return lines


def _length_lines(length: dict) -> list[str]:
    if not length["unseen_tokens_upper_bound"]:
        return [f"  lengths: extraction keeps up to {length['extract_max_length']:,} tokens a sample, training sees "
                f"up to {length['train_seq_len']:,}: every stored token is trained on"]
    return [f"  lengths: extraction keeps up to {length['extract_max_length']:,} tokens a sample but training cuts "
            f"at {length['train_seq_len']:,}: up to {length['unseen_tokens_upper_bound']:,} stored tokens are never "
            f"trained on (set train.seq_len: {length['extract_max_length']} or extract.max_length: "
            f"{length['train_seq_len']})"]


def _hour_lines(p: dict) -> list[str]:
    h = p["hours"]
    lines = [f"  hours ({h['basis']}):"] + _download_lines(p)
    what = {Generate.name: f"completion tokens at C={p['concurrency']}", Extract.name: "tokens stored",
            Train.name: f"tokens trained ({h[Train.name]['epochs']} epochs)"}
    for stage in what:
        s = h[stage]
        rate = f"{s['tokens_per_s']:,.0f} tok/s ({s['source']})" if s["tokens_per_s"] else s["source"]
        took = f"{s['hours']:,.2f} h" if s["hours"] is not None else "? h"
        reused = p.get("states_from") and stage != Train.name
        lines.append(f"    {stage:<8} {took:>10}: " + (f"none: {s['source']} (same settings and rows)" if reused else
                     f"none: {s['source']}" if p.get("answers_from") and stage == Generate.name else
                     f"{s['tokens']:,} {what[stage]} at {rate}"))
    lines.append(f"    total    {h['total']:>8,.2f} h" if h["total"] is not None else
                 "    total: unknown until every rate is given")
    return lines


def _download_lines(p: dict) -> list[str]:
    d, deadline = p["hours"][DOWNLOAD], p["serve_deadline_s"]
    if not d["bytes"]:
        return []
    rate = f"{human(d['bytes_per_s'])}/s ({d['source']})" if d["bytes_per_s"] else d["source"]
    took = f"{d['hours']:,.2f} h" if d["hours"] is not None else "? h"
    lines = [f"    {DOWNLOAD:<8} {took:>10}: the target's weights {human(d['bytes'])} at {rate}"]
    if d["hours"] is not None and d["bytes"] / d["bytes_per_s"] > deadline:
        least = math.ceil(d["bytes"] / d["bytes_per_s"] / 60) * 60
        lines.append(f"    the download alone is longer than EYRIE_SERVE_DEADLINE_S ({deadline:g} s), within which the "
                     f"server must answer: raise it above {least:,} s plus the load, or download the weights into "
                     "the server's HF cache first (`hf download MODEL`)")
    return lines


def _weights_lines(p: dict) -> list[str]:
    weights = f"the target's weights {human(p['target_weights_bytes'])}"
    if not p["target_download_bytes"]:
        return [f"  {weights} ({p['target_weights_from']}): a local directory, nothing to download"]
    return [f"  {weights}, downloaded from the hub into the HF cache of the hosts that serve it (HF_HOME; "
            f"{p['target_weights_from']}) before the server answers: not in the bucket"]


def _support_lines(p: dict) -> list[str]:
    s = p["support"]
    if s["eagle3"]:
        return [f"  vLLM {s['vllm']}: {s['class']} ({s['file']}) implements SupportsEagle3: hidden-state "
                "extraction and EAGLE-3 serving are supported"]
    return [f"  vLLM {s['vllm']}: {s['warning']}"]
