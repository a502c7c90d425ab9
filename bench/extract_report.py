"""extract_throughput's report: its RESULTS.md section (tokens/s per contender, the goals, the reading, bytes per
token, fp8's error, the profile) from the measurements, and the machine and code it ran on."""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import torch

from extract_contenders import VARIANTS

ROOT = Path(__file__).resolve().parent.parent


GPU = ["", "## GPU (H200)", "",
       "Still to be taken: no GPU in this session. Command: `python bench/extract_throughput.py --shape 8b "
       "--device cuda` (random-weight Llama-3-8B shape: 32 layers, hidden 4096, vocab 128256, bf16; "
       "64 samples x 2048 tokens, batches of 8 x 2048; the weights are initialized on the GPU, not saved). "
       "The H200 figures quoted in the issue (naive loop at 45% / 21% of the bound) come from an earlier "
       "session's notes, not from this script."]


def render(r: dict) -> list[str]:
    """The `# Extract throughput` section of bench/RESULTS.md from a run's report."""
    return [*head(r), *tokens_table(r), *goals(r), *reading(r), *bytes_table(r), *fp8_section(r),
            *profile_section(r), *GPU]


def head(r: dict) -> list[str]:
    """The machine, the date and load, the command, the workload, and the tokens/s table's head."""
    res = r["results"]
    other = [m["other_cores"] for ms in res.values() for m in ms]
    n_states = len(r["aux"]) + 1
    cmd = "python bench/" + Path(sys.argv[0]).name + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "")
    out = ["# Extract throughput", "",
           f"- Machine: {r['machine']}.",
           f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. Load average before: "
           f"{r['load_before'][0]:.2f} (1 min) / {r['load_before'][1]:.2f} (5 min); after: {r['load_after'][0]:.2f}. "
           f"Cores busy with other work during the measurements: median {med(other):.2f}, "
           f"{min(other):.2f}-{max(other):.2f} (of {psutil.cpu_count()}).",
           f"- Command: `{cmd}`; {r['total']:.0f} s in all (model built and loaded in {r['t_model']:.0f} s). "
           f"Code: {git_rev()}.",
           f"- Workload: random-weight Llama `{r['shape']}` ({r['n_layers']} layers, hidden {r['hidden']}, "
           f"{r['model_dtype']} weights and compute) on {r['device']}; aux layers {r['aux']} + the last layer "
           f"(pre-norm) = {n_states} states per token; {r['samples']} samples x {r['seq_len']} tokens = "
           f"{r['tokens']:,} tokens in {r['batches']} batches (`token_budget_batches`, EYRIE_EXTRACT_BATCH_TOKENS="
           f"{r['batch_tokens']}); {r['args'].write_threads} write threads; store {r['args'].store} "
           f"(a {'local directory' if r['args'].store == 'file' else 'SeaweedFS S3 server on loopback'}). "
           f"Every contender ran on the same batches, interleaved (the order rotates each round; each one "
           f"that forwards right after a bare forward, its pair), "
           f"{r['args'].rounds} rounds; medians (range).",
           "", "## Tokens/s", "",
           "| contender | what | tok/s median (range) | wall s | own cores | other load, cores |",
           "|---|---|---|---|---|---|"]
    return out


def tokens_table(r: dict) -> list[str]:
    """A row per contender: what it is, its tok/s, wall, and the cores it and others kept busy."""
    res = r["results"]
    out = []
    what = {"fwd": "HFCapture.forward over all batches, nothing copied or written (measured right before each "
                   "contender that forwards: its pair)",
            "fwd_plain": "`model.model(...)`, hooks removed, no stack",
            "write": "store.put_bytes of sample-sized blobs, {t} threads: write ceiling",
            "write1": "the same, one thread (reference)",
            "extract": "ExtractRunner.run(): the extractor",
            "naive": "forward, then per sample .cpu() + save + put_bytes, sequential",
            "ref": "ExtractRunner.run() with shard.py as committed at {ref}",
            **{v: f"PROPOSAL `{v}`: the extractor with {d}" for v, (_, d) in VARIANTS.items()}}
    for name in res:
        kind, _, dtype = name.partition("_")
        label = what["fwd_plain"] if name == "fwd_plain" else what[kind].replace(
            "{t}", str(r["args"].write_threads)).replace("{ref}", f"`{r['args'].ref}` ({r['ref_sha']})")
        if kind == "write":
            bw = med([m["bytes"] / m["wall_s"] for m in res[name]]) / 1e6
            label += f" ({bw:.0f} MB/s / {r['stored'][dtype]['per_token']:.0f} B per token)"
        if kind == "write1":
            bw = med([m["bytes"] / m["wall_s"] for m in res[name]]) / 1e6
            label += f" ({bw:.0f} MB/s)"
        out.append(f"| {name} | {label} | {tok(res, name):.1f} ({rng(res, name)}) | {med([m['wall_s'] for m in res[name]]):.2f} | "
                   f"{med([m['own_cores'] for m in res[name]]):.2f} | {med([m['other_cores'] for m in res[name]]):.2f} |")
    return out


def goals(r: dict) -> list[str]:
    """The issue's goals, each met or not, from the paired ratios and the bytes stored."""
    res, dtypes = r["results"], r["dtypes"]
    n_states = len(r["aux"]) + 1
    raw_bf16 = n_states * r["hidden"] * 2
    out = []
    out += ["", "## Goals (from the issue)", ""]
    goals = []
    for dtype in dtypes:
        ceiling = min(tok(res, "fwd"), tok(res, f"write_{dtype}"))
        bound = "forward" if tok(res, "fwd") <= tok(res, f"write_{dtype}") else "write bandwidth"
        ratio = tok(res, f"extract_{dtype}") / ceiling
        paired = per_round_ratio(res, f"extract_{dtype}", f"write_{dtype}")
        rounds = [m["tok_s"] / min(m["pair_fwd"], res[f"write_{dtype}"][m["round"]]["tok_s"])
                  for m in res[f"extract_{dtype}"]]
        goals.append(f"- {'MET' if paired >= 0.9 else '**NOT MET**'}: extract {dtype} >= 0.90 x min(forward, write "
                     f"ceiling): {paired:.3f}, the median of the paired ratios (each run against the bare forward "
                     f"measured right before it and the same round's write ceiling: the machine's drift cancels; "
                     f"per round: {', '.join(f'{x:.3f}' for x in rounds)}); "
                     f"ratio of the medians {ratio:.3f} ({tok(res, f'extract_{dtype}'):.1f} vs {ceiling:.1f} tok/s, {bound}-bound)")
        if f"ref_{dtype}" in res:
            pairs = paired_vs(res, f"extract_{dtype}", f"ref_{dtype}")
            goals.append(f"  - shard.py at {r['args'].ref} {dtype}: {tok(res, f'ref_{dtype}') / ceiling:.3f} of the same "
                         f"bound (per round {per_round_ratio(res, f'ref_{dtype}', f'write_{dtype}'):.3f}); the working "
                         f"tree's extractor / it, per round: {', '.join(f'{x:.3f}' for x in pairs)}")
        for v in VARIANTS:
            if f"{v}_{dtype}" in res:
                pairs = paired_vs(res, f"{v}_{dtype}", f"extract_{dtype}")
                goals.append(f"  - proposal `{v}` {dtype}: {tok(res, f'{v}_{dtype}') / ceiling:.3f} of the same bound "
                             f"(per round {per_round_ratio(res, f'{v}_{dtype}', f'write_{dtype}'):.3f}); / extractor, "
                             f"per round: {', '.join(f'{x:.3f}' for x in pairs)}")
        if f"naive_{dtype}" in res:
            goals.append(f"  - naive loop {dtype}: {tok(res, f'naive_{dtype}') / ceiling:.3f} of the same bound "
                         f"(per round {per_round_ratio(res, f'naive_{dtype}', f'write_{dtype}'):.3f}); extractor / naive "
                         f"{tok(res, f'extract_{dtype}') / tok(res, f'naive_{dtype}'):.2f}x")
    goals.append(f"  - capture is free? fwd (hooks + stack) / fwd_plain: {tok(res, 'fwd') / tok(res, 'fwd_plain'):.3f}")
    if "bf16" in r["stored"]:
        pt = r["stored"]["bf16"]["per_token"]
        goals.append(f"- {'MET' if pt <= 1.02 * raw_bf16 else '**NOT MET**'}: bf16 bytes per token within 2% of raw "
                     f"({n_states} x {r['hidden']} x 2 = {raw_bf16} B): {pt:.1f} B, {pt / raw_bf16:.4f}x "
                     f"(the int64 token id is 8 B of it, the safetensors header the rest)")
    if "fp8" in r["stored"] and "bf16" in r["stored"]:
        q = r["stored"]["fp8"]["per_token"] / r["stored"]["bf16"]["per_token"]
        goals.append(f"- {'MET' if q <= 0.52 else '**NOT MET**'}: fp8 <= 0.52x of bf16: "
                     f"{r['stored']['fp8']['per_token']:.1f} B per token, {q:.4f}x")
    for dtype, c in r["checks"].items():
        goals.append(f"- stored {dtype} files equal a fresh forward of the first batch: "
                     f"{'yes, bit for bit' if c['bit_exact'] else 'NO, max abs diff %g' % c['max_abs_diff']}")
    out += goals
    return out


def reading(r: dict) -> list[str]:
    """What the figures say: the cores kept busy, the bound, the proposals against the extractor, the load."""
    res, dtypes = r["results"], r["dtypes"]
    out = []
    out += ["", "## Reading", ""]
    busy = [f"{name} {med([m['own_cores'] for m in res[name]]):.2f}" for name in res
            if name.partition("_")[0] in ("fwd", "extract", "naive", *VARIANTS)]
    ceilings = {d: tok(res, f"write_{d}") for d in dtypes}
    bound_line = (("the forward is the bound" if all(c > tok(res, "fwd") for c in ceilings.values()) else
                   "the write bandwidth bounds " + ", ".join(d for d, c in ceilings.items() if c <= tok(res, "fwd")))
                  + " (write ceilings: " + ", ".join(f"{d} {c / tok(res, 'fwd'):.1f}x the forward"
                                                     for d, c in ceilings.items()) + ")")
    out.append(f"- Cores this process kept busy (medians): {', '.join(busy)}. Here {bound_line}.")
    if r["prof"]:
        inside, bare = r["prof"]["phases"].get("capture.forward", 0.0), med([m["wall_s"] for m in res["fwd"]])
        ph = r["prof"]["phases"]
        off = ph.get("_write", 0.0) + ph.get("_put", 0.0)
        out.append(f"- The forward inside the instrumented extractor run took {inside:.2f} s against {bare:.2f} s "
                   f"bare ({inside / bare - 1:+.0%}); writing took {off:.2f} thread-seconds in the write "
                   f"thread(s) (`_write`/`_put`, fsync included) and {ph.get('_serialize', 0.0):.2f} s in the "
                   "forward's thread (`_serialize`).")
    for v in VARIANTS:
        pairs = [x for d in dtypes if f"{v}_{d}" in res for x in paired_vs(res, f"{v}_{d}", f"extract_{d}")]
        if pairs:
            out.append(f"- `{v}` against the extractor in the same round: median {med(pairs):.3f}x, faster in "
                       f"{sum(x > 1 for x in pairs)} of {len(pairs)} rounds.")
    fwd_cores = med([m["own_cores"] for m in res["fwd"]])
    short = [f"{name} {med([m['own_cores'] for m in ms]):.2f}" for name, ms in res.items()
             if name.partition("_")[0] in ("extract", "ref", *VARIANTS)
             and med([m["own_cores"] for m in ms]) < fwd_cores - 0.08]
    if r["device"] == "cpu" and short:
        out.append(f"- Kept fewer cores busy than the bare forward ({fwd_cores:.2f}): {', '.join(short)}. The "
                   "likely mechanism: on a CPU torch's intra-op threads already use every core, so write threads "
                   "working beside the forward run by preempting one of them, and the other waits for it at the "
                   "end of every op; that costs more than the writes' own time.")
    noisy = sum(1 for ms in res.values() for m in ms if m["other_cores"] > 0.25)
    out.append(f"- {noisy} of {sum(len(ms) for ms in res.values())} measurements had other work above 0.25 cores. "
               "Where torch's threads take every core, other work slows the forward far beyond its share "
               "(OpenMP threads descheduled): CPU figures are comparable only from a quiet machine, and the "
               "per-round ratios are the robust ones.")
    if r["device"] != "cpu":
        out.append("- The stored-files check above is also the check of `states.to('cpu', non_blocking=True)` in "
                   "ExtractRunner._run: from a GPU that copy lands in pinned memory asynchronously, and the write "
                   "threads read it with no synchronization.")
    return out


def bytes_table(r: dict) -> list[str]:
    """Bytes per token stored per dtype, against raw bf16."""
    raw_bf16 = (len(r["aux"]) + 1) * r["hidden"] * 2
    out = []
    out += ["", "## Bytes per token stored", "", "| dtype | stored bytes | tokens | bytes/token | vs raw bf16 |",
            "|---|---|---|---|---|"]
    for dtype, s in r["stored"].items():
        out.append(f"| {dtype} | {s['bytes']:,} | {s['tokens']:,} | {s['per_token']:.1f} | {s['per_token'] / raw_bf16:.4f}x |")
    return out


def fp8_section(r: dict) -> list[str]:
    """fp8's error against the bf16 files, per stored layer."""
    out = []
    if r["fp8"]:
        f = r["fp8"]
        out += ["", "## fp8 (e4m3, one fp32 scale per token) error", "",
                "The fp8 files dequantized as training reads them (`hs_connectors.fp8_utils.dequantize_fp8_tensor`, "
                "to bf16; what `FP8Transfer` returns) against the bf16 files of the same samples, all "
                f"{r['tokens']:,} tokens. Relative error per token = ||fp8 - bf16|| / ||bf16|| over the hidden "
                "size; rms = the layer's typical magnitude.", "",
                "| layer | mean rel err | p99 rel err | max rel err | max abs err | rms of the layer |",
                "|---|---|---|---|---|---|"]
        for label, e in f.items():
            if label.startswith("_"):
                continue
            rms = f"{e['rms']:.3g}" if e["rms"] is not None else "-"
            out.append(f"| {label} | {e['mean_rel']:.4f} | {e['p99_rel']:.4f} | {e['max_rel']:.4f} | "
                       f"{e['max_abs']:.4g} | {rms} |")
        out += ["", f"- Dequantized to fp32 instead of bf16: mean rel err {f['_fp32_dequant_mean_rel']:.4f} "
                f"(all layers) vs {f['all']['mean_rel']:.4f}: the bf16 rounding of the scale and the product "
                "adds the difference."]
        if "_fp32_ref" in f:
            out.append(f"- Against the fp32 forward (first batch): bf16 files {f['_fp32_ref']['bf16']:.4f}, fp8 "
                       f"files {f['_fp32_ref']['fp8']:.4f} mean rel err: the scale of bf16 storage's own error.")
        out.append("- A random-weight model has none of a trained Llama's massive activations (a few residual "
                   "dimensions 100-1000x the rest); with one scale per token over all layers and dimensions, "
                   "those set the scale, so the error on a trained target is to be measured on one.")
    return out


def profile_section(r: dict) -> list[str]:
    """The instrumented extractor run: its phases and cProfile."""
    res = r["results"]
    out = []
    if r["prof"]:
        p = r["prof"]
        out += ["", "## Where the extractor's time goes (one more run, instrumented)", "",
                f"Wall {p['wall_s']:.2f} s for {r['tokens']:,} tokens ({r['tokens'] / p['wall_s']:.1f} tok/s; the "
                "wrappers and cProfile slow it). Seconds summed per phase; the write-thread phases add up across "
                "threads.", "", f"- capture.forward inside the extractor: {p['phases'].get('capture.forward', 0):.2f} s; the "
                f"bare forward of the same batches: {med([m['wall_s'] for m in res['fwd']]):.2f} s (median).", "",
                "| phase | s | calls |", "|---|---|---|"]
        for k, v in sorted(p["phases"].items(), key=lambda kv: -kv[1]):
            out.append(f"| {k} | {v:.2f} | {p['counts'][k]} |")
        out += ["", "cProfile of the main thread (cumulative):", "", "```", *p["cprofile"].splitlines()[:40], "```"]
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def tok(res: dict, name: str) -> float:
    return med([m["tok_s"] for m in res[name]])


def rng(res: dict, name: str) -> str:
    v = [m["tok_s"] for m in res[name]]
    return f"{min(v):.0f}-{max(v):.0f}"


def per_round_ratio(res: dict, name: str, ceiling: str) -> float:
    """Each measurement against its own bound: the bare forward measured right before it, and the
    write ceiling of the same round."""
    return med([m["tok_s"] / min(m["pair_fwd"], res[ceiling][m["round"]]["tok_s"]) for m in res[name]])


def paired_vs(res: dict, a: str, b: str) -> list[float]:
    """a against b, each normalized by its own paired forward, round by round."""
    return [(x["tok_s"] / x["pair_fwd"]) / (y["tok_s"] / y["pair_fwd"]) for x, y in zip(res[a], res[b])]


def machine_line(args) -> str:
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    gpu = ""
    if args.device.startswith("cuda") and torch.cuda.is_available():
        gpu = f", GPU {torch.cuda.get_device_name(0)}"
    return (f"{model}, {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM{gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__}, "
            f"safetensors {__import__('safetensors').__version__}, Linux {platform.release()}; "
            f"torch threads {torch.get_num_threads()}")


def git_rev() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "eyrie", "services/extractor"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return f"eyrie at {sha}{' (extractor/eyrie files modified in the working tree)' if dirty else ''}"
    except OSError:
        return "unknown"
