"""Status for people: a table with progress bars, and a live view while waiting."""

from __future__ import annotations

import math
import time

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from eyrie.data.verify_outputs import outputs_summary, set_blocks
from eyrie.runs.status import overall_state, run_status
from eyrie.work.status_models import RunStatus, RunSummary, StageStatus, TrainStatus

console = Console()


def _si(value) -> str:
    if value is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:g}"


def _eta(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


STATE_STYLE = {"done": "green", "in_progress": "yellow", "failed": "red", "pending": "dim", "cancelled": "magenta"}


def stage_table(status: RunStatus) -> Table:
    table = Table(title=f"run {status.run}  ·  {status.target.get('model', '(being planned)')}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("stage", "state", "progress", "done/skip/fail", "tokens", "tok/s", "ETA"):
        table.add_column(column, no_wrap=True, justify="left" if column in ("stage", "state", "progress")
                         else "right")
    for name, s in status.stages.items():
        processed = s.done + s.skipped + s.failed
        bar = Progress(BarColumn(bar_width=10), TextColumn("{task.percentage:>3.0f}%"))
        bar.add_task("", total=max(1, s.total), completed=processed)
        counts = f"step {s.done} of {s.total or '?'}" if isinstance(s, TrainStatus) else \
            f"{s.done}/{s.skipped}/{s.failed} of {s.total}"
        table.add_row(name, f"[{STATE_STYLE.get(s.state, '')}]{s.state}[/]", bar, counts, _si(s.tokens),
                      _si(s.tok_per_s), "-" if s.state == "done" else _eta(s.eta_s))
    return table


def render_status(status: RunStatus) -> None:
    console.print(stage_table(status))
    if status.cancelled:
        console.print(f"[magenta]run cancelled[/] at {status.cancelled}; `eyrie retry {status.run}` resumes it")
    pipeline = status.pipeline
    if pipeline:
        console.print(_pipeline_line(pipeline.stages)
                      + "".join(f"; {name} {task.state}" for name, task in pipeline.tasks.items()))
        if pipeline.blocked:
            console.print(f"[red]pipeline blocked[/] {pipeline.blocked}")
        for name, task in pipeline.tasks.items():
            for error in task.errors:
                console.print(f"[red]{name} error[/] {error}")
    lease = status.gpu_lease
    if lease:
        held = [_lease_line(h) for h in lease.holders or ([lease.holder] if lease.holder else [])]
        waiting = [_lease_line(w) for w in lease.waiters] or lease.waiting
        console.print("gpu leases: " + ("held by " + "; ".join(held) if held else "free")
                      + (f"; waiting: {'; '.join(waiting)}" if waiting else ""))
    endpoint = status.inference
    if endpoint:
        console.print(f"inference: {endpoint.state} at {endpoint.url} ({endpoint.server})"
                      + (f"  {endpoint.progress}" if endpoint.state in ("waiting", "starting") else ""))
    for name, s in status.stages.items():
        render_stage(name, s)


def _lease_line(who: dict) -> str:
    """`extractor@w1 (cuda on GPUs 4,5 of w1)`: a lease's or a waiter's owner, devices and host."""
    gpus = ",".join(who.get("gpus") or [])
    where = "" if not gpus else f" on every GPU of {who.get('host')}" if gpus == "*" else f" on GPUs {gpus} of {who.get('host')}"
    return f"{who.get('owner')} ({who.get('devices')}{where})"


def render_stage(name: str, s: StageStatus) -> None:
    if s.state == "in_progress" and not s.workers:
        console.print(f"[yellow]{name}: no worker is listening; start one with `eyrie worker {name}`[/]")
    for task in s.active:
        console.print(f"  {name} shard {task.shard} on {task.worker}: {task.done} done, "
                      f"{_si(task.tokens)} tokens, {_si(task.tok_per_s)} tok/s"
                      + (f", {_si(task.bytes)}B" if task.bytes else ""))
    if s.bytes:
        console.print(f"{name}: {_si(s.bytes)}B stored"
                      + (f" of {_si(s.projected_bytes)}B projected" if s.projected_bytes else ""))
    for what in s.waiting_for:
        console.print(f"[yellow]{name}: waiting for {what}[/]")
    for error in s.errors:
        console.print(f"[red]{name} error[/] {error}")
    if isinstance(s, TrainStatus):
        render_train(s)
    if s.skip_reasons:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(s.skip_reasons.items()))
        console.print(f"{name} skipped: {reasons}")


def render_train(s: TrainStatus) -> None:
    if s.loss is not None:
        acc = " ".join(f"{a:.2f}" for a in s.acc or [])
        console.print(f"train: epoch {(s.epoch or 0) + 1}/{s.epochs}, loss {s.loss:.3f}, "
                      f"accuracy per TTT step [{acc}]" + (f", val loss {s.val_loss:.3f}" if s.val_loss else ""))
    if s.dropped:
        console.print(f"[yellow]train: {s.dropped} sample(s) left out[/] ({'; '.join(s.drop_reasons)}); "
                      "`eyrie logs RUN` names one of each")
    if s.path:
        console.print(f"train: {s.path['path']} path ({s.path['draft_attn_impl']} attention, "
                      f"{s.path['loss_implementation']} loss)")
    evaluation = s.evaluation
    if evaluation:
        taus = ", ".join(f"{c['label']}: {c['tau']:.2f}" + (" (best)" if c["label"] == evaluation["best"] else "")
                         for c in evaluation["checkpoints"])
        console.print(f"evaluate: tau (K={evaluation['k']}) untrained {evaluation['baseline']['tau']:.2f}; {taus}")
        best = next(c for c in evaluation["checkpoints"] if c["label"] == evaluation["best"])
        if best.get("per_position_acceptance"):
            console.print("evaluate: acceptance per draft position (best) "
                          + " ".join(f"{p:.2f}" for p in best["per_position_acceptance"] if p is not None))
    verify = s.verify
    if verify and verify.get("skipped"):
        console.print(f"verify: skipped: {verify['skipped']}; {verify['fix']}")
    if verify and verify.get("vllm_acceptance_length"):
        console.print(f"verify: vLLM acceptance length {verify['vllm_acceptance_length']:.3f} "
                      f"(eyrie {verify['eyrie_acceptance_length']:.3f}), per position "
                      + " ".join(f"{p:.2f}" for p in verify["vllm_per_position_acceptance"] if p is not None)
                      + f"; outputs {verify.get('outputs_verdict') or ('identical' if verify['identical_outputs'] else 'differ')}, "
                        f"speedup {verify['speedup']}")
    if s.drafter:
        console.print(f"export: {s.drafter['files']['model.safetensors']['key'].rsplit('/', 1)[0]}/ "
                      f"(`eyrie export --run RUN --out DIR`)")


def _pipeline_line(stages: list[str]) -> str:
    if len(stages) == 1:
        return f"run of {stages[0]} alone: nothing starts after it by itself"
    return f"pipeline {' -> '.join(stages)}: next stages start by themselves"


def live_progress(conn, store, run: str, stage: str, poll_s: float = 1.0) -> str:
    """Redraw the status until the stage is done or failed; returns its last state."""
    from rich.live import Live

    with Live(console=console, refresh_per_second=2, transient=True) as live:
        while True:
            status = run_status(conn, store, run)
            live.update(stage_table(status))
            current = status.stages.get(stage)  # a pipeline's later stages appear as they start
            if current and current.state in ("done", "failed", "cancelled"):
                return current.state
            if status.cancelled:
                return "cancelled"
            pipeline = status.pipeline
            if any(s.state == "failed" for s in status.stages.values()) or pipeline and (
                    pipeline.blocked or any(t.state == "failed" for t in pipeline.tasks.values())):
                return "failed"
            time.sleep(poll_s)


def follow_stage(conn, store, run: str, stage: str) -> int:
    """The live view until the stage ends, then the run's status; the exit code `--wait` gives:
    0 done, 3 failed (or blocked), 4 cancelled."""
    final = live_progress(conn, store, run, stage)
    render_status(run_status(conn, store, run))
    return {"failed": 3, "cancelled": 4}.get(final, 0)


def verify_lines(run: str, result: dict) -> list[str]:
    """What `eyrie verify` found (the manifest keeps the same object): eyrie's figure, then a line
    per prompt set and K (MT-Bench's second turn and both turns on lines of their own: set_blocks);
    a figure the result lacks shows as '-'."""
    blocks = set_blocks(result.get("benchmarks") or {})
    width = max([12, *(len(name) for name, _ in blocks)])
    lines = [f"run {run}: checkpoint {result.get('checkpoint', '-')}, eyrie's acceptance length "
             f"{_num(result.get('eyrie_acceptance_length'))} (K={result.get('k', '-')}, held-out samples); "
             f"vLLM {_num(result.get('vllm_acceptance_length'))}"
             + (f" ({100 * result['relative_difference']:.1f}% apart)" if result.get("relative_difference") is not None
                else ""),
             f"  {'set':<{width}} {'prompts':>7} {'K':>2} {'vLLM accept':>11}  {'per position':<30} {'identical':<9} "
             f"{'tok/s @1':>9} {'speedup @1':>10} {'tok/s @8':>9} {'speedup @8':>10}"]
    for name, bench in blocks:
        for k, f in bench["k"].items():
            per_pos = " ".join(_num(p, 2) for p in f.get("vllm_per_position_acceptance") or [])
            lines.append(f"  {name:<{width}} {f.get('prompts', bench['prompts']):>7} {k:>2} "
                         f"{_num(f.get('vllm_acceptance_length')):>11}  "
                         f"{per_pos:<30} {str(f.get('identical_outputs')):<9} {_num(f['tokens_per_s'].get('1'), 1):>9} "
                         f"{_num(f['speedup'].get('1'), 2):>10} {_num(f['tokens_per_s'].get('8'), 1):>9} "
                         f"{_num(f['speedup'].get('8'), 2):>10}")
    lines += [f"  {name} K={k}: outputs {outputs_summary(bench, f)}" for name, bench in blocks
              for k, f in bench["k"].items() if not f.get("identical_outputs")]
    if any(" turn 2" in name for name, _ in blocks):
        lines.append("  turn 2: the second turn, asked after each server's own first answer (the set's own row: its "
                     "first turn); turns 1+2: both turns' counters together")
    return lines


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def runs_table(runs: list[RunSummary]) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("run", "state", "stages", "created", "target"):
        table.add_column(column, no_wrap=column != "target")
    for r in runs:
        stages = "  ".join(f"{name} {_percent(s)}" for name, s in r.stages.items())
        table.add_row(r.run, f"[{STATE_STYLE.get(r.state, '')}]{r.state}[/]", stages, r.created_at or "-", r.target or "-")
    console.print(table if runs else "no runs")


def _percent(s) -> str:
    return f"{100 * (s.done + s.skipped + s.failed) / max(1, s.total):.0f}%"


def watch_status(conn, store, run: str, poll_s: float) -> RunStatus:
    """Redraw the whole run until it is done, failed or cancelled; returns its last status."""
    from rich.live import Live

    with Live(console=console, refresh_per_second=2, transient=True) as live:
        while True:
            status = run_status(conn, store, run)
            live.update(stage_table(status))
            if overall_state(status) in ("done", "failed", "cancelled"):
                return status
            time.sleep(poll_s)


def render_manifest(manifest: dict) -> None:
    """The provenance manifest as sections of `key  value` lines (lists of shards summarized)."""
    shards, used = manifest.pop("generate_shards"), manifest.pop("settings", None) or {}
    for section, value in manifest.items():
        if isinstance(value, dict):
            console.print(f"[bold]{section}[/]")
            for key, item in _flat(value):
                console.print(f"  {key:<28} {item}")
        else:
            console.print(f"[bold]{section:<30}[/] {value}")
    console.print(f"[bold]generate_shards[/]  {len(shards)} shards, rows "
                  f"{shards[0]['row_start'] if shards else 0}..{shards[-1]['row_end'] if shards else 0}")
    render_settings(used)


def render_settings(used: dict) -> None:
    """Every stage setting as used: value and where it came from (eyrie.core.provenance)."""
    if used:
        console.print("[bold]settings as used[/] (value, where from)")
    for section, fields in used.items():
        for name, entry in fields.items():
            console.print(f"  {section + '.' + name:<34} {entry['value']!s:<14} {entry['source']}", markup=False,
                          soft_wrap=True)


def _flat(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


SPARKS = "▁▂▃▄▅▆▇█"
EIGHTHS = "▏▎▍▌▋▊▉"  # a bar's last, partial cell
CHART_WIDTH = 48  # a sparkline's most characters: a line fits 80 columns
EYRIE_STYLE, VLLM_STYLE = "#2f6fd6", "#e07a1f"  # the dashboard's colours


def resample(values: list[float], width: int) -> list[float]:
    """At most `width` values: consecutive ones averaged into `width` buckets when there are more."""
    if len(values) <= width:
        return list(values)
    n = len(values)
    buckets = [values[i * n // width:(i + 1) * n // width] for i in range(width)]
    return [sum(b) / len(b) for b in buckets]


def sparkline(values: list[float], low: float, high: float, width: int = CHART_WIDTH) -> str:
    """One character a value (a blank where it is not finite, e.g. a NaN loss)."""
    span = high - low
    return "".join(" " if not math.isfinite(v) else SPARKS[round((v - low) / span * 7) if span > 0 else 0]
                   for v in resample(values, width))


def bar(value: float, low: float, high: float, width: int = 40) -> str:
    cells = max(0.0, min(1.0, (value - low) / (high - low))) * width
    partial = int((cells - int(cells)) * 8)
    return "█" * int(cells) + (EIGHTHS[partial - 1] if partial else "")


def render_charts(series: dict, out: Console = console) -> None:
    """`eyrie show`'s charts, from eyrie.data.charts.chart_series: sparklines of loss and accuracy per
    TTT position over the steps, bars of acceptance length per checkpoint and per draft position."""
    if series.get("ttt"):
        _ttt_charts(series["ttt"], out)
    if series.get("acceptance_length"):
        _acceptance_length_chart(series["acceptance_length"], out)
        _per_position_chart(series["per_position"], out)
    for name, by_k in (series.get("benchmarks") or {}).items():
        _benchmark_chart(name, by_k, out)


def _benchmark_chart(name: str, by_k: dict, out: Console) -> None:
    """One prompt set verified by vLLM: acceptance length per K, then acceptance per draft position."""
    out.print(f"[bold]vLLM on {name}[/]: acceptance length per K (1..K+1), per draft position (0..1), speedup at 1 / 8 in flight")
    for k, f in by_k.items():
        length, speedup = f["acceptance_length"], f["speedup"]
        out.print(f"  K={k:<3} [{VLLM_STYLE}]{bar(length or 1, 1, int(k) + 1):<40}[/] {length or 0:.3f}  "
                  f"speedup {_num(speedup.get('1'), 2)} / {_num(speedup.get('8'), 2)}"
                  + ("" if f["identical_outputs"] else
                     f"  [{'red' if f.get('outputs_beyond_variance') else 'yellow'}]outputs {f.get('outputs', 'differ')}[/]"))
        for position, rate in enumerate(f["per_position"] or []):
            out.print(f"    +{position + 1:<3} [{VLLM_STYLE}]{bar(rate or 0, 0, 1):<36}[/] {rate or 0:.3f}")


def _ttt_charts(ttt: dict, out: Console) -> None:
    steps = ttt["steps"]
    per_column = steps[-1] / min(len(steps), CHART_WIDTH)  # stored points are averaged to fit the width
    every = f"{per_column:.3g} step{'s' if per_column != 1 else ''} a column"
    for name, what in (("loss", "loss"), ("acc", "accuracy")):
        # one scale for all positions: accuracy from 0, loss from its least value
        finite = [v for values in ttt[name] for v in values if math.isfinite(v)] or [0.0]
        low, high = 0.0 if name == "acc" else min(finite), max(finite)
        out.print(f"[bold]{what} per TTT position[/], steps 1..{steps[-1]}, {every} (scale {low:.3g}..{high:.3g})")
        for position, values in enumerate(ttt[name]):
            out.print(f"  +{position + 1:<3} [{EYRIE_STYLE}]{sparkline(values, low, high)}[/]  "
                      f"{values[0]:.3f} → {values[-1]:.3f}")


def _acceptance_length_chart(acceptance: dict, out: Console) -> None:
    top = acceptance["k"] + 1
    verified = any(row["vllm"] is not None for row in acceptance["checkpoints"])
    out.print(f"[bold]acceptance length per checkpoint[/] (1..{top}): [{EYRIE_STYLE}]eyrie[/]"
              + (f", [{VLLM_STYLE}]vLLM (verified)[/]" if verified else ""))
    for row in acceptance["checkpoints"]:
        label = row["label"] + (" (best)" if row["label"] == acceptance["best"] else "")
        out.print(f"  {label:<12} eyrie [{EYRIE_STYLE}]{bar(row['eyrie'], 1, top):<40}[/] {row['eyrie']:.3f}")
        if row["vllm"] is not None:
            out.print(f"  {'':<12} vLLM  [{VLLM_STYLE}]{bar(row['vllm'], 1, top):<40}[/] {row['vllm']:.3f}")


def _per_position_chart(rates: dict, out: Console) -> None:
    out.print(f"[bold]acceptance per draft position[/] (best checkpoint, 0..1): [{EYRIE_STYLE}]eyrie[/]"
              + (f", [{VLLM_STYLE}]vLLM[/]" if rates["vllm"] else ""))
    for position, ours in enumerate(rates["eyrie"]):
        out.print(f"  +{position + 1:<3} eyrie [{EYRIE_STYLE}]{bar(ours or 0, 0, 1):<40}[/] {ours or 0:.3f}")
        theirs = rates["vllm"][position] if position < len(rates["vllm"]) else None
        if theirs is not None:
            out.print(f"  {'':<4} vLLM  [{VLLM_STYLE}]{bar(theirs, 0, 1):<40}[/] {theirs:.3f}")
