"""bench/storage_modes.py's pure parts (tests/unit/test_benchmarks.py): the prompt slice, the epochs' walls, the
acceptance's standard error, and the RESULTS.md section and chart from the JSON result."""

from __future__ import annotations

import math

from eyrie.work.extract_server import on_demand

from learning_report import COLORS, cell, row
from results import svg_bars


def prompt_slice(lines: list[str], count: int, stride: int) -> list[str]:
    """Every `stride`-th non-empty row from the first, the first `count` of them."""
    rows = [line for line in lines if line.strip()][::stride][:count]
    if len(rows) < count:
        raise SystemExit(f"the dataset has {len(rows)} rows at a stride of {stride}, fewer than {count} prompts")
    return rows


def epoch_walls(loop_started: float | None, checkpoints: dict[str, float], ended: float | None,
                epochs: int) -> dict:
    """Wall seconds of each epoch (loop start, then each epoch's checkpoint stored) and their mean (loop start to
    the evaluation phase, over the epochs)."""
    per, last = [], loop_started
    for label in sorted(checkpoints, key=int):
        if last is not None:
            per.append(checkpoints[label] - last)
        last = checkpoints[label]
    mean = (ended - loop_started) / epochs if loop_started is not None and ended is not None else None
    return {"per_epoch_s": per, "wall_per_epoch_s": mean}


def acceptance_error(length: float | None, per_position: list[float | None], drafts: int) -> float | None:
    """Standard error of vLLM's mean acceptance length (1 + accepted/drafts) over `drafts` drafts. A draft's accepted
    count a is the number of positions accepted in a row, so P(a >= m) is position m's acceptance rate p_m:
    E[a] = sum p_m, E[a^2] = sum (2m - 1) p_m (m from 1)."""
    if length is None or not drafts or any(p is None for p in per_position):
        return None
    mean, square = length - 1, sum((2 * m - 1) * p for m, p in enumerate(per_position, start=1))
    return math.sqrt(max(0.0, square - mean * mean) / drafts)


def same_within_noise(a: dict, b: dict) -> bool | None:
    """Two acceptance lengths differ by at most two standard errors of their difference (independent errors: the
    prompts are shared, so this errs on the side of calling them the same)."""
    if None in (a.get("length"), b.get("length"), a.get("error"), b.get("error")):
        return None
    return abs(a["length"] - b["length"]) <= 2 * math.hypot(a["error"], b["error"])


def expected_requests(samples: list[dict], heldout: set[str], epochs: int) -> int:
    """Requests training makes to the service: each on-demand training sample every epoch, each on-demand held-out
    sample once."""
    train = sum(1 for s in samples if on_demand(s) and s["sample_id"] not in heldout)
    held = sum(1 for s in samples if on_demand(s) and s["sample_id"] in heldout)
    return train * epochs + held


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def section(r: dict, svg: str | None = None) -> list[str]:
    """The RESULTS.md section from the JSON result (every target measured so far)."""
    targets = r["targets"]
    out = ["# Storage modes: offline, hybrid, online (bench/storage_modes.py)", ""]
    for name, t in targets.items():
        m = t["machine"]
        out += [f"- **{name}** ({t['model']}): {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM"
                + (f", {m['gpu']}" if m["gpu"] else ", no GPU") + f"; {t['date']}; commit `{t['commit']}`; "
                f"vLLM {t['vllm']}. Command: `{t['command']}`",
                f"  - {t['prompts']} prompts answered once by the target in vLLM (at most {t['max_tokens']} tokens; "
                f"{t['generate_s']:.0f} s), {t['heldout']} held out; trained {t['epochs']} epochs, lr {t['lr']:g}, "
                f"seq len {t['seq_len']}, draft vocabulary {t['draft_vocab']}, K={t['k']}, on {t['device']}; vLLM "
                f"acceptance on {t['verify_prompts']} held-out prompts, greedy, at most {t['verify_tokens']} tokens."]
    out += ["", row("target", "mode", "stored bytes (bucket)", "peak bytes (trainer cache + service dir)",
                        "of which hidden states", "service requests in training (expected)",
                        "wall / epoch (each epoch)", "vLLM acceptance (± s.e.)", "eyrie τ",
                        "greedy outputs identical with the drafter"), "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in targets.items():
        for mode, x in t["modes"].items():
            acc = x["acceptance"]
            out.append(row(name, mode, _mb(x["stored_bytes"]), _mb(x["peak_bytes"]), _mb(x["peak_state_bytes"]),
                               f"{x['service_requests']} ({x['expected_requests']})",
                               cell(x["wall_per_epoch_s"], ".1f") + " s" + (
                                   f" ({', '.join(f'{w:.1f}' for w in x['per_epoch_s'])})" if x.get("per_epoch_s")
                                   else ""),
                               cell(acc["length"], ".3f") + (
                                   f" ± {acc['error']:.3f}" if acc["error"] is not None else ""),
                               cell(x["eyrie_tau"], ".3f"),
                               {True: "yes", False: "no"}.get(acc.get("identical_outputs"), "-")))
    out += ["", row("target", "mode", "stored bytes", "peak bytes", "wall / epoch", "vLLM acceptance",
                        "same as offline within noise"), "|---|---|---|---|---|---|---|"]
    for name, t in targets.items():
        base = t["modes"]["offline"]
        for mode, x in t["modes"].items():
            if mode != "offline":
                same = same_within_noise(x["acceptance"], base["acceptance"])
                out.append(row(name, f"{mode} / offline", _ratio(x["stored_bytes"], base["stored_bytes"]),
                                   _ratio(x["peak_bytes"], base["peak_bytes"]),
                                   _ratio(x["wall_per_epoch_s"], base["wall_per_epoch_s"]),
                                   _ratio(x["acceptance"]["length"], base["acceptance"]["length"]),
                                   "-" if same is None else ("yes" if same else "no")))
    out += ["", f"![acceptance, wall time per epoch and peak bytes per mode]({svg})"] if svg else []
    return out + ["", *reading(targets)]


def request_wait(mode: dict, offline: dict) -> float | None:
    """Seconds training waited per request to the service: its wall per epoch beyond offline's, over an epoch's
    requests (the held-out ones, fetched once, are counted in: a slight underestimate)."""
    wall, base, n = mode.get("wall_per_epoch_s"), offline.get("wall_per_epoch_s"), mode.get("service_requests")
    epochs = len(mode.get("per_epoch_s") or []) or None
    if None in (wall, base, epochs) or not n:
        return None
    return (wall - base) * epochs / n


def summary(entry: dict) -> dict:
    """An earlier run of a target, in brief: kept beside the newest (the machine is shared: runs differ)."""
    modes = entry["modes"]
    return {"command": entry["command"], "date": entry["date"], "commit": entry["commit"],
            **{key: {m: x.get(key) for m, x in modes.items()} for key in ("wall_per_epoch_s", "load_1m", "peak_bytes")},
            "acceptance": {m: x["acceptance"]["length"] for m, x in modes.items()}}


def earlier_lines(name: str, runs: list[dict]) -> list[str]:
    return [f"- earlier run of **{name}** (`{e['command']}`, {e['date']}, `{e['commit']}`): wall per epoch "
            + ", ".join(f"{m} {cell(w, '.1f')} s" for m, w in e["wall_per_epoch_s"].items())
            + "; load average " + ", ".join(f"{m} {cell(v, '.1f')}" for m, v in e["load_1m"].items())
            + "; vLLM acceptance " + ", ".join(f"{m} {cell(v, '.3f')}" for m, v in e["acceptance"].items()) + "."
            for e in runs]


def reading(targets: dict) -> list[str]:
    """What the numbers say, in words made from them."""
    return [line for name, t in targets.items() for line in (
        f"- **{name}**: " + "; ".join(target_reading(t["modes"])) + ".",
        *earlier_lines(name, t.get("earlier", [])))] + [
        line for note in NOTES for line in ("", note)]


def target_reading(modes: dict) -> list[str]:
    lengths = [x["acceptance"]["length"] for x in modes.values() if x["acceptance"]["length"] is not None]
    same = [same_within_noise(x["acceptance"], modes["offline"]["acceptance"]) for x in modes.values()]
    shas = {x["drafter_sha256"] for x in modes.values() if x.get("drafter_sha256")}
    loads = [f"{m} {x['load_1m']:.1f}" for m, x in modes.items() if x.get("load_1m") is not None]
    out = [f"vLLM acceptance {min(lengths, default=0):.3f}-{max(lengths, default=0):.3f} across the modes, "
           + ("every mode the same as offline within noise" if all(v is not False for v in same)
              else "a mode differs from offline beyond noise"),
           "wall per epoch " + ", ".join(f"{m} {cell(x['wall_per_epoch_s'], '.1f')} s" for m, x in modes.items()),
           f"the service answered {modes['hybrid']['service_requests']} (hybrid) and "
           f"{modes['online']['service_requests']} (online) requests during training, "
           + ("as many as expected" if all(x["service_requests"] == x["expected_requests"] for x in modes.values())
              else "not the number expected") + "; offline trained with it stopped"]
    if loads:
        out.append(f"the machine's 1-minute load average while each trained (2 cores, shared): {', '.join(loads)}")
    waits = {m: request_wait(modes[m], modes["offline"]) for m in ("hybrid", "online")}
    if all(w is not None for w in waits.values()):
        out.append("training waited about " + " and ".join(f"{w:.2f} s ({m})" for m, w in waits.items())
                   + " per request to the service (wall per epoch beyond offline's, over the requests of an epoch): "
                   "the CPU trainer loads samples in its own process (0 loader workers), so it waits for each request")
    if None not in (h := modes["hybrid"]["wall_per_epoch_s"], o := modes["online"]["wall_per_epoch_s"]) and h > o:
        out.append("hybrid's epochs took longer than online's with half the requests: most likely other jobs on the "
                   "shared cores (see the load average and the earlier run), not the mode")
    out += ["the three exported drafters are bit-identical (one sha256)" if len(shas) == 1 else
            f"the exported drafters differ in their bytes ({len(shas)} sha256s)"] if shas else []
    if max(lengths, default=0) < 1.2:
        out.append("drafters trained this briefly accept about one token per step (acceptance ~1.0): the modes are "
                   "compared on drafters that have learnt almost nothing, so agreement here shows the states reach "
                   "training intact, not that a useful drafter comes out the same")
    return out


NOTES = [
    "\"Same within noise\": the difference from offline is at most two standard errors of the difference (each "
    "error from vLLM's own counters: the spread of accepted tokens per draft over the drafts made, computed from the "
    "per-position acceptance rates; the modes' errors treated as independent although the prompts are shared). "
    "The three runs train on the same samples in the same order with speculators' default seed; the states come "
    "from the same vLLM extraction service, stored at extraction or made again during training (in other batches, "
    "so not necessarily to the last bit): the drafters' sha256s say whether the bytes matched.",
    "Peak bytes: the highest sum, sampled every 0.2 s while the train task ran, of the trainer's cache directory "
    "(the materialized training and held-out data, checkpoints, logs) and the service's shared directory (states "
    "written for a request, deleted once read); \"of which hidden states\" counts the data directory and the shared "
    "directory alone. Wall / epoch: the train task's training loop start to its evaluation phase, over the epochs "
    "(data preparation, evaluation and export not in it); the machine was shared with other test runs, so the load "
    "average above says how much of it was ours.",
]


def chart(r: dict) -> str:
    """Bars per mode, grouped by target: vLLM acceptance, wall seconds per epoch, peak MB."""
    pick = lambda f: {name: {m: f(x) for m, x in t["modes"].items()} for name, t in r["targets"].items()}  # noqa: E731
    return svg_bars({"vLLM acceptance length": pick(lambda x: x["acceptance"]["length"]),
                     "wall s / epoch": pick(lambda x: x["wall_per_epoch_s"]),
                     "peak MB (cache + service dir)": pick(
                         lambda x: x["peak_bytes"] / 1e6 if x["peak_bytes"] is not None else None),
                     "stored MB (bucket)": pick(lambda x: x["stored_bytes"] / 1e6)},
                    "Storage modes: offline, hybrid, online (vLLM CPU build as the extraction service)", COLORS)
