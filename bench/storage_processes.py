"""bench/storage_modes.py's processes: a target and how it runs, the real `eyrie` command line, vLLM's extraction
service, and the monitor of a train task's disk and progress."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from eyrie.core.vllm import start_server, stop_server
from eyrie.work import progress
from eyrie_extractor.vllm_backend import connector_env, extract_command
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
METRIC = "vllm:request_success_total"


@dataclass(frozen=True)
class Target:
    """A target and how it is run here: prompts (every `stride`-th row of `dataset`), vLLM flags, training."""
    model: str
    dataset: str
    stride: int
    prompts: int
    max_tokens: int
    layers: str
    max_model_len: int
    vllm_args: str
    sampling: tuple[str, ...]
    seq_len: int
    lr: float
    draft_vocab: int
    heldout: int


def model_path(t: Target) -> str:
    """The target as every process names it (the extraction service, generation and vLLM's model name)."""
    return str(ROOT / t.model)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout_s:g} s")


def eyrie(*args: str, timeout: float = 3600) -> float:
    """The real `eyrie` command line; its wall seconds."""
    started = time.monotonic()
    done = subprocess.run([str(BIN / "eyrie"), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"eyrie {shlex.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.monotonic() - started


class Service:
    """vLLM's extraction service (CPU-safe connector), started as tests/e2e/test_storage_modes.py starts it."""

    def __init__(self, t: Target, settings, work: Path):
        self.port, self.shared, self.log = free_port(), work / "hs-shared", work / "extract-service.log"
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--max-model-len", str(t.max_model_len), *shlex.split(t.vllm_args)]
        cmd = extract_command(model_path(t), [int(x) for x in t.layers.split(",")], self.shared, 1, self.port, flags,
                              vllm_command=settings.vllm_command, cpu=True)
        self.proc = start_server(cmd, env=connector_env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        wait_http(f"{self.url}/v1/models", self.proc, self.log)

    def requests_served(self) -> int:
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(METRIC + "{")))

    def cpu_s(self) -> float:
        """CPU seconds of its whole process tree so far."""
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                total += c.user + c.system
        return total

    def stop(self) -> None:
        stop_server(self.proc, grace_s=60)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (files vanishing meanwhile count 0)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


class Monitor(threading.Thread):
    """While a train task runs: the high-water mark of its cache + the service's directory, every `every_s`, and when
    its live progress shows the training loop start, each checkpoint stored and the evaluation phase."""

    def __init__(self, conn, run: str, cache: Path, shared: Path | None, every_s: float):
        super().__init__(daemon=True)
        self.conn, self.run_name, self.cache, self.shared, self.every_s = conn, run, cache, shared, every_s
        self.stop, self.peak, self.peak_states, self.samples, self.load = threading.Event(), 0, 0, 0, 0.0
        self.loop_started = self.ended = None
        self.checkpoints: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every_s)
        self.sample()

    def sample(self) -> None:
        shared = tree_bytes(self.shared) if self.shared else 0
        data = tree_bytes(self.cache / "runs" / self.run_name / "data")
        self.peak, self.samples = max(self.peak, tree_bytes(self.cache) + shared), self.samples + 1
        self.peak_states = max(self.peak_states, data + shared)
        self.load += os.getloadavg()[0]  # other jobs on the machine show here
        now = time.time()
        for live in progress.read(self.conn, self.run_name, "train").values():
            if self.loop_started is None and "steps_per_epoch" in live:
                self.loop_started = now
            for c in live.get("checkpoints", []):
                self.checkpoints.setdefault(c["label"], now)
            if self.ended is None and live.get("phase") in ("evaluating", "done"):
                self.ended = now
