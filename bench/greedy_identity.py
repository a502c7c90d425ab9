"""Are greedy outputs with the drafter the target's own, in each dtype vLLM can serve? (issue 28's verify finding)

  .venv/bin/python bench/greedy_identity.py --run RUN [--dtypes bfloat16,float32] [--bench gsm8k] [--prompts 40]
On a run with an exported drafter (EYRIE_* as for every eyrie command). Per dtype: vLLM serves the target alone, then
with the drafter (eagle3, the run's K), the same prompts greedy at 8 in flight, as `eyrie verify` does; the alone
server also answers the first --serial prompts one at a time. Counts the outputs that differ and, for each, the first
token where they part: a difference in exact arithmetic would be a defect, a near-tie flipping with the batch's
shape is numerics. The target alone at 1 and at 8 in flight tells the two apart without any drafter. Also vLLM's
acceptance length of the drafter pass per dtype (its /metrics counters); `--bench heldout`: the run's held-out prompts
(those eyrie's τ was measured on).
"""

from __future__ import annotations

import argparse, json, tempfile
from pathlib import Path

from eyrie.core.config import load_settings
from eyrie.data.manifest import load_run_manifest
from eyrie.stages.run_config import stored_config
from eyrie.data.store import open_store
from eyrie_trainer.export import download
from eyrie_trainer.verify import (HELDOUT, Served, answer_limits, benchmark_prompts, heldout_prompts, max_model_len,
                                  serve_flags, spec_counters, summarize)


def parted_at(a: list[int], b: list[int]) -> int | None:
    """The first token index where two answers differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(alone: list[list[int]], other: list[list[int]]) -> dict:
    parts = [parted_at(a, b) for a, b in zip(alone, other)]
    return {"differing": sum(p is not None for p in parts), "of": len(parts),
            "first_differing_token": sorted(p for p in parts if p is not None)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--bench", default="gsm8k", help="a benchmark set, or heldout: the run's held-out prompts")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--serial", type=int, default=8, help="prompts the target alone also answers one at a time")
    p.add_argument("--max-tokens", type=int, default=256)
    a = p.parse_args(argv)
    settings = load_settings()
    store = open_store(settings)
    manifest = load_run_manifest(store, a.run)
    flags = serve_flags(settings, stored_config(store, a.run))
    sets = ({HELDOUT: heldout_prompts(store, a.run, Path(settings.cache_dir))[:a.prompts]} if a.bench == HELDOUT
            else benchmark_prompts(manifest.target.model, [a.bench], a.prompts))
    prompts = sets[a.bench]
    limits = answer_limits(sets, a.max_tokens, max_model_len(flags))[a.bench]
    logs, results = Path(tempfile.mkdtemp(prefix="greedy-identity-")), {}
    with tempfile.TemporaryDirectory() as tmp:
        download(store, a.run, Path(tmp))
        spec = json.dumps({"method": "eagle3", "model": tmp, "num_speculative_tokens": manifest.train.ttt_steps})
        for dtype in a.dtypes.split(","):
            served = [*flags, "--dtype", dtype]
            with Served(settings, manifest.target.model, served, logs / f"{dtype}-alone.log") as server:
                alone, _ = server.greedy(prompts, limits, 8)
                serial, _ = server.greedy(prompts[:a.serial], limits[:a.serial], 1)
            with Served(settings, manifest.target.model, [*served, "--speculative-config", spec],
                        logs / f"{dtype}-drafter.log") as server:
                before = spec_counters(server.url)
                drafted, _ = server.greedy(prompts, limits, 8)
                counted = summarize(before, spec_counters(server.url), manifest.train.ttt_steps)
            results[dtype] = {"drafter_vs_alone_at_8": compare(alone, drafted),
                              "alone_at_1_vs_at_8": compare(alone[:a.serial], serial),
                              "vllm_acceptance_length": counted["vllm_acceptance_length"]}
            print(dtype, json.dumps(results[dtype]), flush=True)
    print(json.dumps({"run": a.run, "bench": a.bench, "prompts": len(prompts), "max_tokens": a.max_tokens,
                      "results": results, "logs": str(logs)}, indent=1))


if __name__ == "__main__":
    main()
