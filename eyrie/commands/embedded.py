"""The embedded default as local processes: the same services `make up` runs in containers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from eyrie.commands.display import console, follow_stage, verify_lines
from eyrie.core.config import load_settings, safe_url
from eyrie.core.run_config import check_run_name
from eyrie.core.vllm import available
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.control import pipeline_started, start_and_plan
from eyrie.stages import PIPELINE
from eyrie.stages.run_config import load_config
from eyrie.stages.verify import Verify
from eyrie.work import inference, keys
from eyrie.work.queue import connect, job_errors, job_state

LOGS = Path(".eyrie/logs")
DRAFTERS = Path(".eyrie/drafters")


def start(name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """One eyrie service as a child process, its output in .eyrie/logs/NAME.log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "eyrie.commands.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


STOP_S = 45  # past `eyrie serve`'s own STOP_GRACE_S (30 s for its model server, a group of its own) and a margin


def stop(proc: subprocess.Popen, timeout: float = STOP_S) -> None:
    """SIGTERM to the process's group, SIGKILL after `timeout`: long enough for a server to stop its own
    model server first (killed sooner, that one outlived it, orphaned)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_demo(config: Path, run: str, dataset: str | None = None) -> int:
    """`eyrie run` on the config (its run name and dataset replaced), with the server and one
    worker per queue started here (a verifier where vLLM is): the pipeline starts each stage by
    itself; the server stops once generation has drained (as vLLM hands over the GPUs). SIGTERM
    stops everything it started, as Ctrl-C does."""
    cfg = demo_config(config, run, dataset)
    settings = load_settings(model=cfg.target.model)
    conn, store = connect(settings.redis_url), open_store(settings)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "EYRIE_SERVE_STOP_WHEN_DRAINED": "1",
           # the verifier serves the drafter with vLLM: its CPU KV cache, in GiB
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    workers = {s.queue: s.worker for s in PIPELINE if not s.needs_vllm or available(settings.vllm_command)}
    console.print(f"[bold]eyrie demo[/]: `eyrie run --config {config}` as run {run}: Redis "
                  f"{safe_url(settings.redis_url)}, store {store.url}, target {cfg.target.model} on "
                  f"{SERVERS[settings.server]}; logs in {LOGS}/")
    procs, interrupt = [], HeldInterrupt()
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with interrupt.held():
            procs.append(start("inference", ["serve", "--config", str(config)], env))
        started = time.monotonic()
        inference.wait_ready(conn, 300)
        console.print(f"inference ready in {time.monotonic() - started:.1f} s")
        for queue, name in workers.items():
            with interrupt.held():
                procs.append(start(name, ["worker", queue], env))
        console.print(pipeline_started(start_and_plan(settings, conn, store, cfg)))
        return follow(conn, store, cfg)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in reversed(procs):
            stop(proc)


SERVERS = {"transformers": "transformers serve (CPU)", "vllm": "vLLM (EYRIE_VLLM_COMMAND)"}


class HeldInterrupt:
    """SIGTERM as Ctrl-C (the caller stops its children on the way out), held while a child starts:
    raised inside Popen, after the fork, it would leave that child running and unknown to the caller."""

    def __init__(self):
        self.holding, self.pending = False, False

    def __call__(self, signum, frame):
        if self.holding:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            raise KeyboardInterrupt


def demo_config(config: Path, run: str, dataset: str | None):
    """The config with the demo's run name (and dataset), checked as `eyrie run` checks a file."""
    cfg = load_config(config)
    return cfg.model_copy(update={"run": check_run_name(run), "dataset": cfg.dataset.model_copy(
        update={"source": dataset or cfg.dataset.source})})


def follow(conn, store, cfg) -> int:
    """Each stage live as the pipeline starts it; then the drafter exported, and vLLM's verdict."""
    for stage in [s for s in PIPELINE if s.shown and not isinstance(s, Verify)]:  # verify: wait_verified
        code = follow_stage(conn, store, cfg.run, stage.name)
        if stage is PIPELINE[0]:
            report(conn, store, cfg.run)
        if code:
            return code
    code = cli(["export", "--run", cfg.run, "--out", str(DRAFTERS / cfg.run)], {})
    if code:
        return code
    return wait_verified(conn, store, cfg.run)


def wait_verified(conn, store, run: str, poll_s: float = 2.0) -> int:
    """The verify stage (the verifier serves the drafter with vLLM: two starts, minutes), or why it
    was skipped."""
    task = Verify.work.task_id(run)
    while (result := load_run_manifest(store, run).verify) is None:
        state, blocked = job_state(conn, task), conn.get(keys.blocked(run))
        if state == "canceled" or conn.exists(keys.cancelled(run)):
            return 4
        if state == "failed" or blocked:
            for error in job_errors(conn, [task]) + ([blocked.decode()] if blocked else []):
                console.print(f"[red]verify error[/] {error}")
            return 3
        time.sleep(poll_s)
    if result.get("skipped"):
        console.print(f"verify: skipped: {result['skipped']}; {result['fix']}")
        return 0
    for line in verify_lines(run, result):
        print(line)
    return 0


def cli(args: list[str], env: dict) -> int:
    return subprocess.run([sys.executable, "-m", "eyrie.commands.cli", *args], env={**os.environ, **env}).returncode


def report(conn, store, run: str) -> None:
    layout = Layout(run)
    keys = [k for k in store.list(layout.generate_shards) if k.endswith(".jsonl")]
    if keys:
        first = next((r for r in map(orjson.loads, store.get_bytes(keys[0]).splitlines())
                      if r["status"] == "done"), None)
        if first:
            console.print(f"example: [dim]{first['messages'][-1]['content']!r}[/]\n"
                          f"  reasoning ({first['reasoning_source']}): {first['reasoning']!r}\n"
                          f"  answer: {first['content']!r}")
    console.print(f"shards: {len(keys)} in {store.url}/{layout.generate_shards}  ·  "
                  f"again any time: eyrie status {run}")
