"""generate_throughput's report: each run summarized, the medians per client and latency, the tables, the goals
and the reading in words, and its section of bench/RESULTS.md."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from generate_clients import CLIENTS


GOAL_IN_FLIGHT = 0.98  # issue 14: mean in flight >= 0.98*C over 2,000 requests at 1 s


def summarize(r: dict) -> dict:
    s, p = r["server"], r["proc"]
    n = max(1, s["answered"])
    window_cpu = p["sampler"].cpu_between(s["first_start_mono"], s["last_end_mono"]) if s["window_s"] else None
    return {"client": r["client"], "latency": r["latency"], "requests": s["answered"], "each_once": s["each_once"],
            "req_per_s": s["req_per_s"], "mean_in_flight": s["mean_in_flight"], "max_in_flight": s["max_in_flight"],
            "window_s": s["window_s"], "wall_s": p["wall_s"], "cpu_s": p["cpu_s"],
            "cpu_per_1000": p["cpu_s"] / n * 1000, "window_cpu_s": window_cpu or 0.0,
            "window_cpu_per_1000": (window_cpu or 0.0) / n * 1000,
            "window_cpu_util": (window_cpu or 0.0) / max(1e-9, s["window_s"]),
            "e2e_req_per_s": s["answered"] / p["wall_s"],
            "own_req_per_s": s["answered"] / r["own"]["wall_s"] if r["own"].get("wall_s") else None,
            "stub_cpu_util": r["stub_cpu_s"] / max(1e-9, s["window_s"]), "other_load": r["other_load"],
            "loss_ramp_s": s["loss_ramp_s"], "loss_turnaround_s": s["loss_turnaround_s"],
            "loss_tail_s": s["loss_tail_s"], "own": r["own"], "check": r["check"], "plan": r.get("plan")}


def median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float) and all(isinstance(r[key], float) for r in rows):
            out[key] = statistics.median(r[key] for r in rows)
    out["each_once"] = all(r["each_once"] for r in rows)
    out["range_req_per_s"] = (min(r["req_per_s"] for r in rows), max(r["req_per_s"] for r in rows))
    out["range_in_flight"] = (min(r["mean_in_flight"] for r in rows), max(r["mean_in_flight"] for r in rows))
    out["n"] = len(rows)
    return out


def medians(rows: list[dict]) -> dict[tuple[float, str], dict]:
    keys = sorted({(r["latency"], r["client"]) for r in rows})
    return {k: median_row([r for r in rows if (r["latency"], r["client"]) == k]) for k in keys}


def _range(pair) -> str:
    return f"{pair[0]:.0f}-{pair[1]:.0f}" if pair[0] != pair[1] else f"{pair[0]:.0f}"


def table(med: dict) -> str:
    lines = ["| latency | client | requests/s at server (range) | mean in flight at server (range) "
             "| client CPU s / 1000 req, request window | client CPU s / 1000 req, end to end "
             "| requests/s over the client's own task wall | end-to-end wall s |",
             "|" + "---|" * 8]
    for latency in sorted({k[0] for k in med}, reverse=True):
        for name in CLIENTS:
            r = med.get((latency, name))
            if not r:
                continue
            label = {"bare": "bare (reference)", "variant": "eyrie variant (--variant)"}.get(name, name)
            own = f"{r['own_req_per_s']:.1f}" if r.get("own_req_per_s") else "-"
            lines.append(f"| {latency:g} s | {label} | {r['req_per_s']:.1f} ({_range(r['range_req_per_s'])}) "
                         f"| {r['mean_in_flight']:.1f} ({_range(r['range_in_flight'])}) "
                         f"| {r['window_cpu_per_1000']:.2f} | {r['cpu_per_1000']:.2f} | {own} | {r['wall_s']:.1f} |")
        e, sp = med.get((latency, "eyrie")), med.get((latency, "speculators"))
        if e and sp:
            own = (f"{e['own_req_per_s'] / sp['own_req_per_s']:.2f}x"
                   if e.get("own_req_per_s") and sp.get("own_req_per_s") else "-")
            lines.append(f"| {latency:g} s | **eyrie / speculators** | **{e['req_per_s'] / sp['req_per_s']:.2f}x** "
                         f"| {e['mean_in_flight'] / sp['mean_in_flight']:.2f}x "
                         f"| {e['window_cpu_per_1000'] / max(1e-9, sp['window_cpu_per_1000']):.2f}x "
                         f"| {e['cpu_per_1000'] / sp['cpu_per_1000']:.2f}x | {own} "
                         f"| {e['wall_s'] / sp['wall_s']:.2f}x |")
    return "\n".join(lines)


def where_table(med: dict, c: int) -> str:
    lines = ["| latency | client | server window s | ideal s (N x latency / C) | slots empty: ramp s "
             "| turnaround s | tail s | client CPU, % of one core in window | stub CPU, % of one core "
             "| other load on the machine, cores |", "|" + "---|" * 10]
    for (latency, name), r in sorted(med.items(), key=lambda kv: (-kv[0][0], CLIENTS.index(kv[0][1]))):
        lines.append(f"| {latency:g} s | {name} | {r['window_s']:.2f} | {r['requests'] * latency / c:.2f} "
                     f"| {r['loss_ramp_s']:.2f} | {r['loss_turnaround_s']:.2f} | {r['loss_tail_s']:.2f} "
                     f"| {r['window_cpu_util']:.0%} | {r['stub_cpu_util']:.0%} | {r['other_load']:.2f} |")
    return "\n".join(lines)


def goals(med: dict, c: int) -> list[tuple[str, bool, str]]:
    out = []
    top = max(k[0] for k in med)
    for latency in sorted({k[0] for k in med}, reverse=True):
        e, sp = med[(latency, "eyrie")], med[(latency, "speculators")]
        ratio = e["req_per_s"] / sp["req_per_s"]
        out.append((f"requests/s >= 1.0x speculators at {latency:g} s", ratio >= 1.0,
                    f"{ratio:.2f}x, {e['req_per_s']:.1f} vs {sp['req_per_s']:.1f} req/s"))
        if latency == top:
            need = GOAL_IN_FLIGHT * c
            bare = med.get((latency, "bare"))
            note = f"; the bare floor client: {bare['mean_in_flight']:.1f}" if bare else ""
            out.append((f"mean in flight >= {GOAL_IN_FLIGHT}*C = {need:.0f} at {latency:g} s", e["mean_in_flight"] >= need,
                        f"eyrie {e['mean_in_flight']:.1f} at the server, {e['own']['mean_in_flight']} by its own "
                        f"count{note}"))
    ok = all(r["each_once"] for r in med.values())
    out.append(("every prompt asked exactly once (stub /stats), every run", ok, "yes" if ok else "NO"))
    return out


def reading(med: dict, c: int, rows: list[dict]) -> list[str]:
    """What the numbers say, in words, from the numbers."""
    out = []
    latencies = sorted({k[0] for k in med}, reverse=True)
    top, low = latencies[0], latencies[-1]
    e, sp, b = med.get((top, "eyrie")), med.get((top, "speculators")), med.get((top, "bare"))
    load = max(r["other_load"] for r in rows)
    if e and sp:
        empty = e["loss_ramp_s"] + e["loss_turnaround_s"] + e["loss_tail_s"]
        line = (f"At {top:g} s eyrie answered {e['req_per_s'] / sp['req_per_s']:.2f}x speculators' requests/s and kept "
                f"{e['mean_in_flight']:.1f} of C={c} requests in flight at the server (by its own count "
                f"{e['own']['mean_in_flight']}), against a goal of {GOAL_IN_FLIGHT * c:.0f}; its best run kept "
                f"{max(r['mean_in_flight'] for r in rows if r['client'] == 'eyrie' and r['latency'] == top):.1f}. "
                f"The slots stood empty for {empty:.2f} s of the {e['window_s']:.2f} s window (ramp "
                f"{e['loss_ramp_s']:.2f}, turnaround {e['loss_turnaround_s']:.2f}, tail {e['loss_tail_s']:.2f}); the "
                f"window exceeds the ideal {e['requests'] * top / c:.2f} s by the handler time too.")
        if b:
            gap = b["mean_in_flight"] - e["mean_in_flight"]
            why = ("lost between the stub and any one-process client on this machine (a burst of up to C "
                   "large answers at once, written by the stub and read by the client, every wave; the last "
                   "wave's spread makes the tail)")
            line += f" The bare floor client, which keeps nothing, kept {b['mean_in_flight']:.1f}"
            if gap <= 0.5:
                line += f": eyrie is at or above the floor, so the empty slots are {why}, not in eyrie's per-record work."
            else:
                line += (f", {gap:.1f} more than eyrie; the floor itself is {GOAL_IN_FLIGHT * c - b['mean_in_flight']:.1f} short "
                         f"of the goal, so most empty slots are {why}, and up to {gap:.1f} are eyrie's per-answer "
                         "work or run-to-run noise (compare the ranges).")
        out.append(line)
    e, sp, b = med.get((low, "eyrie")), med.get((low, "speculators")), med.get((low, "bare"))
    if e and sp and low != top:
        out.append(f"At {low:g} s the 2 vCPUs are the limit: the stub used {e['stub_cpu_util']:.0%} of a core with "
                   f"eyrie, eyrie {e['window_cpu_util']:.0%}; speculators used {sp['window_cpu_util']:.0%} of a core and "
                   f"left the stub {sp['stub_cpu_util']:.0%}. Per 1000 answers in the request window eyrie spent "
                   f"{e['window_cpu_per_1000']:.2f} CPU s, speculators {sp['window_cpu_per_1000']:.2f} "
                   f"({sp['window_cpu_per_1000'] / max(1e-9, e['window_cpu_per_1000']):.1f}x), the bare floor "
                   f"{b['window_cpu_per_1000']:.2f}. Per answer speculators (per its source) parses the JSON with "
                   "the stdlib, decodes all prompt+completion token ids to text with the tokenizer (its review-only "
                   "`text` field), json.dumps a row with input_ids, loss_mask and that text, flushes the file and "
                   "updates tqdm; eyrie parses with orjson and writes its parts from a thread."
                   if b else "")
    for latency in latencies:
        e, sp = med.get((latency, "eyrie")), med.get((latency, "speculators"))
        if e and sp and e["own"].get("wall_s") and sp["own"].get("wall_s"):
            out.append(f"End to end at {latency:g} s: the eyrie worker took {e['wall_s']:.1f} s "
                       f"({e['wall_s'] - e['own']['wall_s']:.1f} s of it start-up, RQ and exit around a "
                       f"{e['own']['wall_s']:.1f} s task; planning with `eyrie generate` is another ~1 s), "
                       f"speculators {sp['wall_s']:.1f} s ({sp['wall_s'] - sp['own']['wall_s']:.1f} s of it "
                       "importing torch/transformers/datasets and loading the tokenizer).")
            break
    if load > 0.3:
        out.append(f"The machine was not idle: other work used up to {load:.2f} of its 2 cores during these "
                   "runs (see the last column above). All clients ran interleaved under the same conditions, "
                   "but absolute numbers are lower and noisier than on an idle machine (see the ranges).")
    return out


def write_results(path: Path, args, info, med, rows, checks, prof, total) -> None:
    """The section at the top of `path`; only it is replaced: the extract section below it is kept."""
    lines = header(args, info, med, rows, total) + details(med, args.concurrency, rows, checks, prof)
    old = path.read_text() if path.exists() else ""
    marker = "\n# Extract throughput\n"
    rest = old[old.index(marker):] if marker in old else ""
    path.write_text("\n".join(lines).rstrip("\n") + "\n" + rest)


def header(args, info, med, rows, total) -> list[str]:
    """The machine, the command, the workload, how it is measured, and the table."""
    c, cmd = args.concurrency, " ".join(["python bench/generate_throughput.py", *sys.argv[1:]])
    load = max(r["other_load"] for r in rows)
    return [
        "# Generate throughput: eyrie vs speculators `regenerate-responses`"
        + (f", {args.turns}-turn conversations" if args.turns > 1 else ""),
        "",
        f"- Machine: {info['line']}; {info['packages']}.",
        f"- Date: {info['date']}. Cores busy with other work just before the start: {info['idle_load']:.2f}; "
        f"during the runs at most {load:.2f}" + (f" (the benchmark ran at niceness {os.nice(0)})." if args.nice else "."),
        f"- Command: `{cmd}` (also `make bench`); {total:.0f} s in all. Code: {info['code']}.",
        f"- Workload: {args.prompts} distinct ShareGPT prompts"
        + (f" of {args.turns} user turns each (every turn answered in order, with the client's own earlier answers "
           f"in the context: {args.prompts * args.turns} requests)" if args.turns > 1 else "")
        + f", concurrency C={c}, max tokens {args.tokens}; eyrie "
        f"plans them in shards of {args.shard_size or args.prompts} (one worker: its task takes on the next shard "
        "while the last answers of the current one arrive). The stub "
        f"(tests/support/stub_openai.py, via bench/timed_stub.py) answers each request after a fixed latency with "
        f"{args.tokens} tokens split into `reasoning` and `content` and, asked with `return_token_ids` (both "
        "clients ask), the prompt and completion token ids: about 11 kB of JSON per answer. Each run gets a "
        f"fresh stub; each client ran {args.repeat} times per latency, the order rotating; the table shows "
        "medians (range of the runs in brackets).",
        "",
        "How it is measured, the same way for every client, at the server: requests/s = answered requests / "
        "(last answer - first arrival); mean in flight = time-weighted requests inside the stub's handler over "
        "that window. Client CPU = user+system of the client's process tree (eyrie: the RQ worker, its forked "
        "work horse and scheduler; speculators: its one process), per 1000 requests: inside the request window "
        "(the tree sampled with psutil every 50 ms on the stub's monotonic clock) and end to end (os.wait4: "
        "start-up and imports included; speculators imports torch/transformers/datasets and loads a tokenizer). "
        "\"Own task wall\": eyrie's shard task wall (`wall_s` in the RQ job result: input read, requests, parts, "
        "shard and manifest written); speculators' \"Pipeline complete in\" (after its tokenizer is loaded). "
        "End-to-end wall = the client command from exec to exit (eyrie: the worker; planning with "
        "`eyrie generate` runs before it: see the details).",
        "",
        "The stub, the client and Redis share the 2 vCPUs. At 0.05 s the ideal rate C/latency = "
        f"{c / min(args.latencies):.0f} req/s is far above what the one-process stub can serve, so that latency "
        "measures how much CPU each client leaves to the server; at 1.0 s it measures how well the client keeps "
        "C requests in flight. `bare` is a reference, not a competitor: bench/bare_client.py, aiohttp + "
        "orjson.loads with nothing kept, the floor for a one-process asyncio client against this stub here.",
        "",
        table(med),
    ]


def details(med, c: int, rows, checks, prof) -> list[str]:
    """The goals, the reading, where the time goes, every run, and the profile."""
    lines = ["", "## Goals (from the issue)", ""]
    lines += [f"- {'MET' if ok else '**NOT MET**'}: {name}: {value}" for name, ok, value in checks]
    lines += ["", "## Reading", ""] + [f"- {line}" for line in reading(med, c, rows) if line]
    lines += [
        "",
        "## Where the time goes",
        "",
        "Server window against the ideal, and the C slots' empty time split into ramp (before the first C "
        "requests arrived), turnaround (an answer had left the handler, the client's next request had not yet "
        "arrived) and tail (after the last arrival, the last answers trickle in); in seconds of all C slots, "
        "medians. CPU shares are of one core.",
        "",
        where_table(med, c),
        "",
        "## Every run",
        "",
    ]
    for r in rows:
        plan = r["plan"]
        extra = f"; planning (`eyrie generate`) {plan['wall_s']:.1f} s wall, {plan['cpu_s']:.2f} s CPU" if plan else ""
        lines.append(f"- {r['latency']:g} s {r['client']}: {r['req_per_s']:.1f} req/s, {r['mean_in_flight']:.1f} "
                     f"in flight (max {r['max_in_flight']}), window {r['window_s']:.2f} s, client CPU "
                     f"{r['window_cpu_s']:.2f} s in the window / {r['cpu_s']:.2f} s end to end, "
                     f"{r['wall_s']:.1f} s wall, other load {r['other_load']:.2f} cores; own report {r['own']}; "
                     f"{r['check']}{extra}")
    if prof:
        lines += ["", "## Profile of eyrie's task", "", "```", prof, "```"]
    return lines
