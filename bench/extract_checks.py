"""extract_throughput's checks after the rounds: the stored files against a fresh forward, fp8's error against
the bf16 files (and both against the fp32 forward), and one more extractor run under phase timers and cProfile."""

from __future__ import annotations

import cProfile
import io
import pstats
import threading
import time

import torch
from safetensors.torch import load as st_load

from eyrie.data.manifest import Layout
from eyrie_extractor import shard as xs

from extract_contenders import Bench


def stored_equals_forward(bench: Bench, runs: dict[str, str]) -> dict:
    """The first batch forwarded again: do the stored files hold exactly these states?"""
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    batch = bench.batches[0]
    states = bench.capture.forward(batch).to("cpu")
    order = [r["sample_id"] for r in bench.records_by_batch[0]]
    out = {}
    for dtype, run in runs.items():
        worst, same = 0.0, True
        for row, (ids, sample_id) in enumerate(zip(batch, order)):
            got = st_load(bench.store.get_bytes(Layout(run).extract_sample(0, sample_id)))
            same &= got["token_ids"].tolist() == ids
            ref = states[row, : len(ids)]
            if dtype == "fp8":
                fp8, scales = quantize_tensor_to_fp8(ref)
                same &= torch.equal(got[SCALES_KEY], scales)
                a, b = got["hidden_states"].float(), fp8.float()
            else:
                a, b = got["hidden_states"].float(), ref.to(torch.bfloat16).float()
            diff = (a - b).abs().max().item()
            worst, same = max(worst, diff), same and diff == 0.0
        out[dtype] = {"bit_exact": same, "max_abs_diff": worst}
    return out


def fp8_error(bench: Bench, runs: dict[str, str], fp32_ref: torch.Tensor | None) -> dict:
    """fp8 (dequantized to bf16 as training does) vs the bf16 file, per stored layer."""
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

    labels = [f"aux {i}" for i in bench.capture.aux_layers] + [f"last ({bench.capture.num_layers}, pre-norm)"]
    rel = {label: [] for label in labels + ["all"]}
    rel32, maxabs, rms = [], {label: 0.0 for label in labels}, {label: [] for label in labels}
    for batch_records in bench.records_by_batch:
        for record in batch_records:
            sid = record["sample_id"]
            b = st_load(bench.store.get_bytes(Layout(runs["bf16"]).extract_sample(0, sid)))["hidden_states"].float()
            f = st_load(bench.store.get_bytes(Layout(runs["fp8"]).extract_sample(0, sid)))
            deq = dequantize_fp8_tensor(f["hidden_states"], f[SCALES_KEY], torch.bfloat16).float()
            deq32 = dequantize_fp8_tensor(f["hidden_states"], f[SCALES_KEY], torch.float32)
            diff = deq - b
            for j, label in enumerate(labels):
                maxabs[label] = max(maxabs[label], diff[:, j].abs().max().item())
                rel[label].append(diff[:, j].norm(dim=-1) / b[:, j].norm(dim=-1).clamp_min(1e-30))
                rms[label].append(b[:, j].pow(2).mean(dim=-1))
            rel["all"].append(diff.flatten(1).norm(dim=-1) / b.flatten(1).norm(dim=-1).clamp_min(1e-30))
            rel32.append((deq32 - b).flatten(1).norm(dim=-1) / b.flatten(1).norm(dim=-1).clamp_min(1e-30))
    out = {}
    for label in labels + ["all"]:
        r = torch.cat(rel[label])
        out[label] = {"mean_rel": r.mean().item(), "p99_rel": torch.quantile(r, 0.99).item(),
                      "max_rel": r.max().item(),
                      "max_abs": maxabs.get(label, max(maxabs.values())),
                      "rms": torch.cat(rms[label]).mean().sqrt().item() if label in rms else None}
    out["_fp32_dequant_mean_rel"] = torch.cat(rel32).mean().item()
    if fp32_ref is not None:  # the model runs in fp32 (CPU): what bf16 storage itself costs
        out["_fp32_ref"] = fp32_ref_errors(bench, runs, fp32_ref)
    return out


def fp32_ref_errors(bench: Bench, runs: dict[str, str], states: torch.Tensor) -> dict:
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

    errs = {"bf16": [], "fp8": []}
    for row, record in enumerate(bench.records_by_batch[0]):
        ref = states[row, : len(bench.batches[0][row])].float()
        b = st_load(bench.store.get_bytes(Layout(runs["bf16"]).extract_sample(0, record["sample_id"])))
        f = st_load(bench.store.get_bytes(Layout(runs["fp8"]).extract_sample(0, record["sample_id"])))
        deq = dequantize_fp8_tensor(f["hidden_states"], f[SCALES_KEY], torch.bfloat16).float()
        for name, got in (("bf16", b["hidden_states"].float()), ("fp8", deq)):
            errs[name].append((got - ref).flatten(1).norm(dim=-1) / ref.flatten(1).norm(dim=-1))
    return {k: torch.cat(v).mean().item() for k, v in errs.items()}


class PhaseTimer:
    """Wall time inside wrapped functions, summed per phase (threads add up: thread-seconds)."""

    def __init__(self):
        self.lock, self.totals, self.counts = threading.Lock(), {}, {}

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self.lock:
                    self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
                    self.counts[name] = self.counts.get(name, 0) + 1
        return timed


def profile_extract(bench: Bench, dtype: str) -> dict:
    timer = PhaseTimer()
    patches = [(xs, "save"), (xs, "sample_tensors"), (xs, "load_tokenizer"), (xs, "generated_records"),
               *((next((c for c in xs.ExtractRunner.__mro__ if name in vars(c)), xs.ExtractRunner), name)
                 for name in ("_render_todo", "_collect", "_flush", "_finish", "_write", "_serialize", "_put",
                              "_report"))]  # where each is defined (_flush, _finish, _report: eyrie.tasks.sharded)
    saved = [(obj, name, obj.__dict__[name]) for obj, name in patches if name in obj.__dict__]
    for obj, name, fn in saved:
        setattr(obj, name, timer.wrap(name, fn))
    store_put = bench.store.put_bytes
    bench.store.put_bytes = timer.wrap("store.put_bytes", store_put)
    capture_forward = bench.capture.forward
    bench.capture.forward = timer.wrap("capture.forward", capture_forward)
    bench.before(f"extract_{dtype}")
    prof = cProfile.Profile()
    try:
        t0 = time.perf_counter()
        prof.enable()
        bench.extract(dtype)
        prof.disable()
        wall = time.perf_counter() - t0
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        del bench.store.put_bytes
        del bench.capture.forward
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(22)
    return {"wall_s": wall, "phases": dict(timer.totals), "counts": dict(timer.counts),
            "cprofile": "\n".join(line for line in text.getvalue().splitlines() if line.strip())}
