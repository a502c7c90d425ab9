"""Status for people: a table with progress bars, and a live view while waiting."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

console = Console()


def _eta(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def stage_table(status: dict) -> Table:
    table = Table(title=f"run {status['run']}  ·  target {status['target']['model']}")
    for column in ("stage", "state", "progress", "done", "skipped", "failed", "total", "tokens",
                   "tok/s", "ETA"):
        table.add_column(column, justify="right" if column not in ("stage", "state", "progress") else "left")
    for name, s in status["stages"].items():
        processed = s["done"] + s["skipped"] + s["failed"]
        bar = Progress(BarColumn(bar_width=24), TextColumn("{task.percentage:>3.0f}%"))
        bar.add_task("", total=max(1, s["total"]), completed=processed)
        table.add_row(name, s["state"], bar, str(s["done"]), str(s["skipped"]), str(s["failed"]),
                      str(s["total"]), str(s["tokens"]), str(s["tok_per_s"] or "-"), _eta(s["eta_s"]))
    return table


def render_status(status: dict) -> None:
    console.print(stage_table(status))
    endpoint = status.get("inference")
    if endpoint:
        console.print(f"inference: {endpoint['state']} at {endpoint['url']} ({endpoint['server']})"
                      + (f"  {endpoint['progress']}" if endpoint["state"] == "starting" else ""))
    for name, s in status["stages"].items():
        if s.get("skip_reasons"):
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(s["skip_reasons"].items()))
            console.print(f"{name} skipped: {reasons}")


def live_progress(conn, store, run: str, stage: str, poll_s: float = 1.0) -> dict:
    """Redraw the status until the stage is done or failed; returns its last status."""
    from rich.live import Live

    from eyrie.status import run_status

    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while True:
            status = run_status(conn, store, run)
            live.update(stage_table(status))
            if status["stages"][stage]["state"] in ("done", "failed"):
                return status["stages"][stage]
            time.sleep(poll_s)
