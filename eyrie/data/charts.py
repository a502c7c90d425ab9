"""The series people look at rather than read: loss and accuracy per TTT position over the
training steps (the trainer's curve: live in Redis while it trains, train/curve.json in the store
with each checkpoint), acceptance length per checkpoint (eyrie's, and vLLM's verified figure) and
acceptance per draft position. The status API (`charts` of the train stage) and `eyrie show` both
take them from eyrie.stages.train.train_charts."""

from __future__ import annotations

import re

from eyrie.data.verify_outputs import BEYOND, FAILED, outputs_summary, set_blocks

MAX_POINTS = 512  # a curve this long has its neighbouring points averaged in pairs


def per_position(metrics: dict, name: str) -> list[float]:
    """speculators' `{name}_{k}` metrics of one step, in TTT-position order (k = 0, 1, ...)."""
    pattern = re.compile(rf"^{re.escape(name)}_(\d+)$")
    found = {int(m.group(1)): value for key, value in metrics.items() if (m := pattern.match(key))}
    return [float(found[k]) for k in sorted(found)]


def _mean(rows: list[list[float]]) -> list[float]:
    return [sum(column) / len(column) for column in zip(*rows)]


class Curve:
    """Loss and full accuracy per TTT position, one point per `stride` training steps (the mean of
    those steps; the stride doubles each time the curve outgrows MAX_POINTS). As stored:
    {"stride", "steps": [last step of each point], "loss": [[per position] per point], "acc": ...}."""

    def __init__(self, stored: dict | None = None, max_points: int = MAX_POINTS):
        self.data = stored or {"stride": 1, "steps": [], "loss": [], "acc": []}
        self.max_points, self._pending = max_points, []

    def add_record(self, record: dict) -> None:
        """One record speculators logs on 'speculators.metrics' (only a step's train metrics count)."""
        if "train" in record:
            self.add(record["global_step"] + 1, record["train"])

    def add(self, step: int, metrics: dict) -> None:
        """One step's train metrics, as speculators logs them."""
        self._pending.append((step, per_position(metrics, "loss"), per_position(metrics, "full_acc")))
        if len(self._pending) >= self.data["stride"]:
            self._append(self._pending)
            self._pending = []
        if len(self.data["steps"]) >= self.max_points:
            self._halve()

    def _append(self, bucket: list) -> None:
        self.data["steps"].append(bucket[-1][0])
        self.data["loss"].append(_mean([loss for _, loss, _ in bucket]))
        self.data["acc"].append(_mean([acc for _, _, acc in bucket]))

    def _halve(self) -> None:
        d = self.data
        starts = range(0, len(d["steps"]), 2)  # an odd last point stays as it is
        d["steps"] = [d["steps"][min(i + 1, len(d["steps"]) - 1)] for i in starts]
        d["loss"], d["acc"] = ([_mean(d[key][i:i + 2]) for i in starts] for key in ("loss", "acc"))
        d["stride"] *= 2

    def resumed_at(self, step: int) -> None:
        """Training continues from `step` (a checkpoint): the points past it are dropped."""
        keep = sum(1 for s in self.data["steps"] if s <= step)
        for key in ("steps", "loss", "acc"):
            self.data[key] = self.data[key][:keep]
        self._pending = []

    def snapshot(self) -> dict:
        """The curve as stored, with the steps not yet making a full point as one more point."""
        data = {key: list(value) if isinstance(value, list) else value for key, value in self.data.items()}
        if self._pending:
            data["steps"].append(self._pending[-1][0])
            data["loss"].append(_mean([loss for _, loss, _ in self._pending]))
            data["acc"].append(_mean([acc for _, _, acc in self._pending]))
        return data


def _by_position(points: list[list[float]]) -> list[list[float]]:
    return [list(series) for series in zip(*points)]


def chart_series(evaluation: dict | None, verify: dict | None, curve: dict | None) -> dict:
    """From train/evaluation.json, the manifest's `verify` and train/curve.json (each may be absent):
    `ttt` (steps; loss and acc, one series per TTT position), `acceptance_length` (k, best, one
    row per checkpoint from the untrained baseline on: eyrie's figure, vLLM's where verified) and
    `per_position` (the best checkpoint's acceptance per draft position: eyrie, vLLM) and
    `benchmarks` (vLLM's figures per verified prompt set and K)."""
    series: dict = {}
    if verify and verify.get("benchmarks"):
        series["benchmarks"] = benchmark_series(verify["benchmarks"])
    if curve and curve.get("steps"):
        series["ttt"] = {"steps": curve["steps"], "stride": curve["stride"],
                         "loss": _by_position(curve["loss"]), "acc": _by_position(curve["acc"])}
    if not evaluation:
        return series
    vllm = verify if verify and verify.get("vllm_acceptance_length") else {}
    rows = [{"label": "untrained", "eyrie": evaluation["baseline"]["tau"], "vllm": None}]
    rows += [{"label": c["label"], "eyrie": c["tau"],
              "vllm": vllm["vllm_acceptance_length"] if vllm.get("checkpoint") == c["label"] else None}
             for c in evaluation["checkpoints"]]
    series["acceptance_length"] = {"k": evaluation["k"], "best": evaluation["best"], "checkpoints": rows}
    best = next(c for c in evaluation["checkpoints"] if c["label"] == evaluation["best"])
    series["per_position"] = {"eyrie": best.get("per_position_acceptance") or [],
                              "vllm": vllm.get("vllm_per_position_acceptance") or []}
    return series


def benchmark_series(benchmarks: dict) -> dict:
    """Per prompt set (MT-Bench's second turn and both turns beside it: set_blocks), per K: vLLM's acceptance
    length, its rate per draft position and the speedups."""
    return {name: {k: {"acceptance_length": f["vllm_acceptance_length"], "per_position": f["vllm_per_position_acceptance"],
                       "speedup": f["speedup"], "identical_outputs": f["identical_outputs"],
                       "outputs": outputs_summary(bench, f),
                       "outputs_beyond_variance": f.get("outputs_verdict") in (BEYOND, FAILED)}
                   for k, f in bench["k"].items()} for name, bench in set_blocks(benchmarks)}
