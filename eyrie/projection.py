"""`eyrie run --plan`: what a pipeline will store, from its config alone (no server, no GPU, no
dataset download): an upper bound on the hidden states, in bf16 and fp8, against the budget."""

from __future__ import annotations

from pathlib import Path

from eyrie.errors import EyrieError
from eyrie.pipeline import RunConfig

RECORD_BYTES_PER_TOKEN = 4  # a generated JSONL record: text + token ids, about 4 bytes a token


def target_shape(config: RunConfig) -> tuple[int, int, int, str]:
    """(hidden, layers, vocab, where from): the target's config if this host can read it (local
    directory or HF cache), else the shape written in the run config."""
    from eyrie.target import text_config

    try:
        c = text_config(config.target.model)
        return c.hidden_size, c.num_hidden_layers, c.vocab_size, "the target's config"
    except EyrieError:
        shape = config.target.shape
        if shape is None:
            raise EyrieError(f"cannot read the config of {config.target.model} here (no hub access or cache).",
                             "add target.shape (hidden_size, num_hidden_layers, vocab_size) to the run config, "
                             "or run --plan where the model is available.") from None
        return shape.hidden_size, shape.num_hidden_layers, shape.vocab_size, "target.shape in the run config"


def samples(config: RunConfig) -> int:
    d = config.dataset
    if Path(d.source).exists():
        from eyrie_generator.dataset import resolve

        return resolve(d.source, d.split, d.revision, d.limit).row_end
    if d.limit is None:
        raise EyrieError(f"--plan cannot count the rows of {d.source} without downloading it.",
                         "set dataset.limit in the run config (the rows the run will use).")
    return d.limit


def project(config: RunConfig, default_max_tokens: int) -> dict:
    from eyrie_extractor.budget import parse_size, projected_bytes
    from eyrie_extractor.layers import resolve_aux_layers

    hidden, num_layers, vocab, shape_from = target_shape(config)
    aux = resolve_aux_layers(config.extract.layers, num_layers)
    n = samples(config)
    max_tokens = config.generate.max_tokens or default_max_tokens
    tokens = n * (config.generate.prompt_tokens_estimate + max_tokens)
    states = len(aux) + 1
    sizes = {dtype: projected_bytes(tokens, n, states, hidden, dtype) for dtype in ("bf16", "fp8")}
    budget = parse_size(config.extract.budget) if config.extract.budget else None
    chosen = sizes[config.extract.dtype]
    per_1k = {dtype: projected_bytes(1000 * n, n, states, hidden, dtype) for dtype in ("bf16", "fp8")}
    return {"per_1k_tokens_per_sample": per_1k, "run": config.run, "target": config.target.model, "shape_from": shape_from, "hidden_size": hidden,
            "num_layers": num_layers, "vocab_size": vocab, "aux_layers": aux, "samples": n,
            "max_tokens": max_tokens, "tokens_upper_bound": tokens, "hidden_states_bytes": sizes,
            "records_bytes": n * max_tokens * RECORD_BYTES_PER_TOKEN, "dtype": config.extract.dtype,
            "trainer_local_bytes": chosen,  # the trainer copies every stored hidden-state file to its disk
            "budget_bytes": budget, "fits": None if budget is None else chosen <= budget}


def render(p: dict) -> list[str]:
    from eyrie_extractor.budget import human

    lines = [f"run {p['run']}: plan (no server, no GPU)",
             f"  target {p['target']}: hidden {p['hidden_size']}, {p['num_layers']} layers, vocab "
             f"{p['vocab_size']:,} (from {p['shape_from']})",
             f"  samples {p['samples']:,}; at most {p['tokens_upper_bound']:,} tokens (prompt estimate + "
             f"max_tokens {p['max_tokens']:,} each)",
             f"  hidden states: layers {p['aux_layers']} + last; at most "
             f"{human(p['hidden_states_bytes']['bf16'])} in bf16, {human(p['hidden_states_bytes']['fp8'])} in fp8",
             f"  (each 1,000 tokens of mean sample length: {human(p['per_1k_tokens_per_sample']['bf16'])} bf16, "
             f"{human(p['per_1k_tokens_per_sample']['fp8'])} fp8)",
             f"  generated records: at most {human(p['records_bytes'])}",
             f"  trainer's local copy of the hidden states ({p['dtype']}, on the trainer's host: EYRIE_CACHE_DIR, "
             f"EYRIE_TRAINER_CACHE_DIR in the stack): at most {human(p['trainer_local_bytes'])}"]
    if p["budget_bytes"] is not None:
        per_1k = p["per_1k_tokens_per_sample"][p["dtype"]]
        mean_fits = int(1000 * p["budget_bytes"] / per_1k)
        verdict = "the upper bound fits" if p["fits"] else (
            f"the upper bound does NOT fit; it fits while samples average at most {mean_fits:,} tokens "
            f"(extract refuses before any forward pass if the real ones do not; fp8 halves the bytes)")
        lines.append(f"  budget {human(p['budget_bytes'])}, {p['dtype']}: {verdict}")
    lines.append("  extract checks the real projection (actual tokens) before any forward pass.")
    return lines
