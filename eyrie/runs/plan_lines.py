"""What `eyrie run --plan` prints: a `Plan` (eyrie/runs/plan_result.py) as lines of text."""

from __future__ import annotations

import math
from pathlib import Path

from eyrie.core.budget import human
from eyrie.core.file_hashes import HASH_BYTES_PER_S, uncached_bytes
from eyrie.runs.plan_checks import budget_verdict, gpu_lines
from eyrie.runs.plan_result import DOWNLOAD, Lengths, Plan, Space
from eyrie.runs.storage_plan import sharing_lines, storage_lines
from eyrie.stages.extract import Extract
from eyrie.stages.generate import Generate
from eyrie.stages.train import Train


def render(p: Plan) -> list[str]:
    return (_head_lines(p) + _weights_lines(p) + _identity_lines(p) + _space_lines(p.space) + _length_lines(p.lengths)
            + _hour_lines(p)
            + [f"  train recipe (on {p.train_recipe.device}): {p.train_recipe.statement}"]
            + storage_lines(p)
            + _support_lines(p) + gpu_lines(p) + sharing_lines(p)
            + ["  extract checks the real projection (actual tokens) before any forward pass."])


def _head_lines(p: Plan) -> list[str]:
    """The target, the samples, the bytes of every hidden state and record, against extract.budget."""
    lines = [f"run {p.run}: plan (no server, no GPU)",
             f"  target {p.target}: hidden {p.hidden_size}, {p.num_layers} layers, vocab "
             f"{p.vocab_size:,} (from {p.shape_from}); architecture {p.architecture or 'unknown'}",
             f"  samples {p.samples:,} ({p.dataset_from}); {p.requests['statement']}; at most "
             f"{p.tokens_upper_bound:,} tokens (prompt estimate + max_tokens {p.max_tokens:,} each)"
             + (f"; expected mean {p.mean_tokens:,} tokens a sample ({p.mean_tokens_from})" if p.mean_tokens
                else "; the mean sample length is unknown (a hub dataset: set plan.mean_tokens)"),
             f"  hidden states: layers {p.aux_layers} + last; at most "
             f"{human(p.hidden_states_bytes['bf16'])} in bf16, {human(p.hidden_states_bytes['fp8'])} in fp8"
             + (f"; expected {human(p.hidden_states_bytes_expected)} in {p.dtype}"
                if p.hidden_states_bytes_expected else ""),
             f"  (each 1,000 tokens of mean sample length: {human(p.per_1k_tokens_per_sample['bf16'])} bf16, "
             f"{human(p.per_1k_tokens_per_sample['fp8'])} fp8)",
             f"  generated records: at most {human(p.records_bytes)}"]
    if p.budget_bytes is not None:
        lines.append(f"  budget {human(p.budget_bytes)}, {p.dtype}: {budget_verdict(p)}")
    if p.decided_elsewhere:
        here = ", ".join(f"{name} {entry['value']} ({entry['source']})" for name, entry in p.decided_elsewhere.items())
        lines.append(f"  decided on the generator host when it plans (its EYRIE_<FIELD>, else the default), "
                     f"not given in the run config: {here} here")
    return lines


def _space_lines(s: Space) -> list[str]:
    lines = [f"  every copy ({s.basis}, {s.mode}): bucket {human(s.bucket_bytes)} (hidden states + records), "
             f"the trainer's local copy {human(s.trainer_copy_bytes)} (on the trainer's host: "
             "EYRIE_CACHE_DIR, EYRIE_TRAINER_CACHE_DIR in the stack)"]
    if s.bucket_free is not None:
        both = " (the trainer's copy is on the same device: counted against it too)" if s.same_device else ""
        lines.append(f"  free at {s.bucket_dir}: {human(s.bucket_free)}{both}: "
                     + ("fits" if s.fits_bucket else "does NOT fit"))
    else:
        lines.append("  the bucket's free space is not visible here (the S3 server does not say it; MinIO's admin "
                     "info does): set plan.store_path (MinIO's data directory, EYRIE_DATA_DIR) or rely on "
                     "extract.budget")
    if s.trainer_free is not None and not s.same_device:
        lines.append(f"  free at {s.trainer_dir} (trainer): {human(s.trainer_free)}: "
                     + ("fits" if s.fits_trainer else "does NOT fit"))
    elif s.trainer_free is None:
        lines.append("  the trainer's free space is not known here: no `eyrie worker train` reports it to this Redis "
                     "(each does every 30 s); start the trainer, or set plan.trainer_cache_path")
    return lines


def _length_lines(length: Lengths) -> list[str]:
    if not length.unseen_tokens_upper_bound:
        return [f"  lengths: extraction keeps up to {length.extract_max_length:,} tokens a sample, training sees "
                f"up to {length.train_seq_len:,}: every stored token is trained on"]
    return [f"  lengths: extraction keeps up to {length.extract_max_length:,} tokens a sample but training cuts "
            f"at {length.train_seq_len:,}: up to {length.unseen_tokens_upper_bound:,} stored tokens are never "
            f"trained on (set train.seq_len: {length.extract_max_length} or extract.max_length: "
            f"{length.train_seq_len})"]


def _hour_lines(p: Plan) -> list[str]:
    h = p.hours
    lines = [f"  hours ({h['basis']}):"] + _download_lines(p)
    what = {Generate.name: f"completion tokens at C={p.concurrency}", Extract.name: "tokens stored",
            Train.name: f"tokens trained ({h[Train.name]['epochs']} epochs)"}
    for stage in what:
        s = h[stage]
        rate = f"{s['tokens_per_s']:,.0f} tok/s ({s['source']})" if s["tokens_per_s"] else s["source"]
        took = f"{s['hours']:,.2f} h" if s["hours"] is not None else "? h"
        reused = p.states_from and stage != Train.name
        lines.append(f"    {stage:<8} {took:>10}: " + (f"none: {s['source']} (same settings and rows)" if reused else
                     f"none: {s['source']}" if p.answers_from and stage == Generate.name else
                     f"{s['tokens']:,} {what[stage]} at {rate}"))
    lines.append(f"    total    {h['total']:>8,.2f} h" if h["total"] is not None else
                 "    total: unknown until every rate is given")
    return lines


def _download_lines(p: Plan) -> list[str]:
    d, deadline = p.hours[DOWNLOAD], p.serve_deadline_s
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


def _weights_lines(p: Plan) -> list[str]:
    weights = f"the target's weights {human(p.target_weights_bytes)}"
    if not p.target_download_bytes:
        return [f"  {weights} ({p.target_weights_from}): a local directory, nothing to download"]
    return [f"  {weights}, downloaded from the hub into the HF cache of the hosts that serve it (HF_HOME; "
            f"{p.target_weights_from}) before the server answers: not in the bucket"]


def _identity_lines(p: Plan) -> list[str]:
    """What naming the target costs (eyrie.core.target.describe): a hub id's commit and its files'
    digests are the hub's; a local directory's files are hashed once per host, here from this
    host's cache (the generate and serve hosts keep their own)."""
    if p.target_download_bytes:
        return ["  target identity: the hub's commit and its files' sha256 (the hub's metadata): nothing hashed"]
    pending = uncached_bytes(Path(p.target))
    if not pending:
        return ["  target identity: every file's sha256 is in this host's hash cache: a stat per file"]
    return [f"  target identity: first hash of {human(pending)} ≈ {_duration(pending / HASH_BYTES_PER_S)} at "
            f"{human(HASH_BYTES_PER_S)}/s (measured, bench/RESULTS.md); later looks: a stat per file"]


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2g} s"
    return f"{seconds / 60:,.0f} min" if seconds < 5400 else f"{seconds / 3600:,.1f} h"


def _support_lines(p: Plan) -> list[str]:
    s = p.support
    if s["eagle3"]:
        return [f"  vLLM {s['vllm']}: {s['class']} ({s['file']}) implements SupportsEagle3: hidden-state "
                "extraction and EAGLE-3 serving are supported"]
    return [f"  vLLM {s['vllm']}: {s['warning']}"]
