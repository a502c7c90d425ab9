"""The embedded default as local processes: the same services `make up` runs in containers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eyrie import inference
from eyrie.config import load_settings, safe_url
from eyrie.display import console
from eyrie.queue import connect
from eyrie.store import open_store
from eyrie.vllm import available

LOGS = Path(".eyrie/logs")
DRAFTERS = Path(".eyrie/drafters")


def start(name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """One eyrie service as a child process, its output in .eyrie/logs/NAME.log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "eyrie.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_demo(run: str, dataset: str) -> int:
    settings = load_settings()
    conn, store = connect(settings.redis_url), open_store(settings)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    console.print(f"[bold]eyrie demo[/]: Redis {safe_url(settings.redis_url)}, store {store.url}, "
                  f"target {settings.model} on transformers serve (CPU); logs in {LOGS}/")
    procs = [start("inference", ["serve"], env)]
    try:
        started = time.monotonic()
        inference.wait_ready(conn, 300)
        console.print(f"inference ready in {time.monotonic() - started:.1f} s")
        procs.append(start("generator", ["worker", "generate"], env))
        code = cli(["generate", "--dataset", dataset, "--run", run, "--concurrency", "8",
                    "--max-tokens", "256", "--shard-size", "16", "--wait"], env)
        report(conn, store, run)
        if code:
            return code
        stop(procs.pop(0))  # generation drained: the server goes, the extractor comes
        procs.append(start("extractor", ["worker", "extract"], env))
        code = cli(["extract", "--run", run, "--wait"], env)
        if code:
            return code
        stop(procs.pop())  # hidden states stored: the extractor goes, the trainer comes
        procs.append(start("trainer", ["worker", "train"], env))
        # the tiny target's corpus is small: short packed batches, a high learning rate, 12 epochs
        code = cli(["train", "--run", run, "--epochs", "12", "--seq-len", "256", "--lr", "3e-3",
                    "--draft-vocab", "500", "--wait"], env)
        if code:
            return code
        code = cli(["export", "--run", run, "--out", str(DRAFTERS / run)], env)
        if code or not available(settings.vllm_command):
            return code
        # the drafter served by vLLM (EYRIE_VLLM_COMMAND): its acceptance length beside ours
        return cli(["verify", "--run", run], {**env, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    finally:
        for proc in reversed(procs):
            stop(proc)


def cli(args: list[str], env: dict) -> int:
    return subprocess.run([sys.executable, "-m", "eyrie.cli", *args], env={**os.environ, **env}).returncode


def report(conn, store, run: str) -> None:
    from eyrie.manifest import Layout

    layout = Layout(run)
    keys = [k for k in store.list(f"{layout.root}/generate/shards/") if k.endswith(".jsonl")]
    if keys:
        import orjson

        first = next((r for r in map(orjson.loads, store.get_bytes(keys[0]).splitlines())
                      if r["status"] == "done"), None)
        if first:
            console.print(f"example: [dim]{first['messages'][-1]['content']!r}[/]\n"
                          f"  reasoning ({first['reasoning_source']}): {first['reasoning']!r}\n"
                          f"  answer: {first['content']!r}")
    console.print(f"shards: {len(keys)} in {store.url}/{layout.root}/generate/shards/  ·  "
                  f"again any time: eyrie status {run}")
