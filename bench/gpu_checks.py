"""Every GPU check we have, in one command, under 10 minutes on one H200:

    .venv/bin/python bench/gpu_checks.py --out DIR        # on the GPU machine
    .venv/bin/python bench/gpu_checks.py --dry-run        # anywhere: what it would run and measure

Checks (each in its own process, under its own time limit; the GPU's memory is read with nvidia-smi
before and after each one, and each holds eyrie's GPU lease in a redis-server of our own while it runs):

  extract   bench/extract_throughput.py at the 8B shape: the extractor against the bare forward on
            the same batches (goal: extract >= 0.90 x min(forward, write ceiling)).
  train     bench/train_throughput.py at the 8B shape, twice: sdpa + eager loss, eyrie against
            speculators' own `train` (tok/s, peak memory); then eyrie with the fast path on (flex
            attention, fused Triton loss, torch.compile): did it run or fall back, and at what tok/s,
            with which torch/triton pair.
  verify    `eyrie verify` (issue 11) on a small real-shaped model: vLLM serves the target with the
            drafter, greedy outputs equal the target's alone, vLLM's own acceptance counters.
  memory    a process takes the GPU lease, allocates GPU memory, releases the lease and exits: the
            memory must be back to the idle level within 10 s (the next lease holder gets it all).

Writes DIR/gpu-checks.json and DIR/RESULTS.md (the benchmarks' own sections); copy the numbers into
bench/RESULTS.md. --dry-run runs on the CPU (a test in `make test`): it prints the plan, checks that
every script exists and takes every flag given to it, and says whether `eyrie verify` is in this build.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.processes import start_redis, stop

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
LIMIT_S = 600  # the whole run, on one H200 (building the train run alone took 117 s there)

CHECKS = [
    {"name": "extract", "budget_s": 150,
     "argv": [PY, "bench/extract_throughput.py", "--shape", "8b", "--device", "cuda", "--samples", "48",
              "--seq-len", "2048", "--rounds", "2", "--dtype", "bf16", "--out", "{out}/RESULTS.md"],
     "measures": "tokens/s of the extractor (hooks, host copy, safetensors write to a file store) against the bare "
                 "forward on the same batches at the Llama-3-8B shape (32 x 4096, vocab 128256), bf16, and the "
                 "store's write ceiling; the ratio against the goal 0.90"},
    {"name": "train", "budget_s": 200,
     "argv": [PY, "bench/train_throughput.py", "--device", "cuda", "--hidden", "4096", "--vocab", "128256",
              "--layers", "32", "--samples", "32", "--seq-len", "2048", "--total-seq-len", "8192",
              "--draft-vocab", "32000", "--workers", "4", "--rounds", "1", "--out-md", "{out}/RESULTS.md"],
     "measures": "tokens/s and peak GPU memory of eyrie's train task against speculators' own `train` "
                 "(sdpa + eager loss on both sides) at the 8B shape, 8192 tokens a step"},
    {"name": "train-fast-path", "budget_s": 120,
     "argv": [PY, "bench/train_throughput.py", "--device", "cuda", "--hidden", "4096", "--vocab", "128256",
              "--layers", "32", "--samples", "32", "--seq-len", "2048", "--total-seq-len", "8192",
              "--draft-vocab", "32000", "--workers", "4", "--rounds", "1", "--fast-path", "on", "--no-write"],
     "measures": "whether speculators' fast path (flex attention, fused Triton loss, torch.compile) trains with this "
                 "torch/triton pair or falls back to sdpa + eager (the error), its tokens/s and peak memory"},
    {"name": "verify", "budget_s": 110,
     "argv": [str(BIN / "eyrie"), "verify", "--help"],
     "verify_argv": os.environ.get("EYRIE_GPU_VERIFY_ARGS", ""),
     "measures": "vLLM (GPU build) serving a small real-shaped target with its exported EAGLE-3 drafter: greedy "
                 "outputs equal to the target's alone, acceptance length and speedup from vLLM's own counters"},
    {"name": "memory", "budget_s": 20, "argv": [PY, __file__, "--hold-lease", "{redis}"],
     "measures": "GPU memory back to the idle level within 10 s of a lease holder releasing the lease and exiting "
                 "(nvidia-smi memory.used, before, while held, after)"},
]


def plan(out: str = "OUT", redis_url: str = "REDIS") -> list[dict]:
    checks = []
    for check in CHECKS:
        argv = [a.format(out=out, redis=redis_url) for a in check["argv"]]
        if check["name"] == "verify" and check["verify_argv"]:
            argv = argv[:2] + shlex.split(check["verify_argv"])
        checks.append({**check, "argv": argv, "command": shlex.join(argv)})
    return checks


def dry_run(as_json: bool) -> int:
    """What the GPU run would do; every script exists and takes its flags; `eyrie verify` present?"""
    checks = plan()
    for check in checks:
        check["status"] = _ready(check)
    total = sum(c["budget_s"] for c in checks)
    report = {"mode": "dry-run", "limit_s": LIMIT_S, "budget_s": total, "checks": checks}
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        print(f"gpu checks: {len(checks)} checks, {total} s of {LIMIT_S} s budgeted (dry run: nothing measured)")
        for c in checks:
            print(f"- {c['name']} ({c['budget_s']} s, {c['status']}): {c['command']}\n    measures: {c['measures']}")
    return 0 if total <= LIMIT_S and all(c["status"] != "broken" for c in checks) else 1


def _ready(check: dict) -> str:
    """ready | missing (a command another issue brings, not in this build) | broken (fix this script)."""
    argv = check["argv"]
    if check["name"] == "verify":
        if not Path(argv[0]).exists():
            return f"missing: no `eyrie` console script at {argv[0]} (pip install -e . first)"
        help_run = subprocess.run([argv[0], "verify", "--help"], capture_output=True, text=True, timeout=120)
        return "ready" if help_run.returncode == 0 else "missing: `eyrie verify` is not in this build (issue 11)"
    if check["name"] == "memory":
        return "ready"
    script = ROOT / argv[1]
    if not script.exists():
        return "broken"
    help_text = subprocess.run([PY, str(script), "--help"], capture_output=True, text=True, timeout=300,
                               cwd=ROOT).stdout
    flags = [a for a in argv[2:] if a.startswith("--")]
    unknown = [f for f in flags if f not in help_text]
    return "ready" if not unknown else f"broken: {script.name} has no {', '.join(unknown)}"


def gpu_memory_mib() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [int(x) for x in out.split()]


def hold_lease(redis_url: str) -> int:
    """Child of the memory check: lease, 8 GiB on the GPU, release, exit."""
    import redis
    import torch

    from eyrie.work.gpu import GpuLease

    lease = GpuLease(redis.Redis.from_url(redis_url), "gpu-checks")
    lease.acquire(wait_s=30)
    block = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    print(json.dumps({"held_mib": gpu_memory_mib()}), flush=True)
    lease.release()
    return 0


def run_all(out: Path, only: set[str] | None = None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eyrie-gpu-checks-"))
    redis_proc, redis_url = start_redis(work)
    results, started = [], time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "EYRIE_REDIS_URL": redis_url}
    try:
        results.append({"name": "versions", **_versions()})
        for check in plan(str(out), redis_url):
            if only and check["name"] not in only:
                continue
            left = LIMIT_S - (time.monotonic() - started)
            results.append(_run_check(check, min(check["budget_s"] * 1.5, left), env, out))
            (out / "gpu-checks.json").write_text(json.dumps(results, indent=1))
    finally:
        stop(redis_proc)
        shutil.rmtree(work, ignore_errors=True)
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "tail"}))
    return 0


def _run_check(check: dict, limit: float, env: dict, out: Path) -> dict:
    if limit < 10:
        return {"name": check["name"], "status": "not run: the 8-minute budget is spent"}
    if check["name"] == "verify" and not check["verify_argv"]:
        status = _ready(check)
        if status != "ready":
            return {"name": "verify", "status": status}
        return {"name": "verify", "status": "not run: set EYRIE_GPU_VERIFY_ARGS (the `eyrie verify` arguments)"}
    before, t0 = gpu_memory_mib(), time.monotonic()
    log = out / f"{check['name']}.log"
    try:
        with log.open("w") as f:
            proc = subprocess.run(check["argv"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {limit:.0f} s"
    wall = time.monotonic() - t0
    after = _settled_memory(before)
    text = log.read_text(errors="replace")
    return {"name": check["name"], "status": status, "wall_s": round(wall, 1), "gpu_mib_before": before,
            "gpu_mib_after": after, "memory_freed": all(a <= b + 256 for a, b in zip(after, before)),
            "tail": text[-4000:]}


def _settled_memory(before: list[int], wait_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        now = gpu_memory_mib()
        if all(a <= b + 256 for a, b in zip(now, before)) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def _versions() -> dict:
    probe = ("import json, torch\ntry:\n import triton; t = triton.__version__\nexcept Exception as e: t = repr(e)\n"
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'triton': t, "
             "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="Print the plan and check it; no GPU needed.")
    parser.add_argument("--json", action="store_true", help="With --dry-run: the plan as JSON.")
    parser.add_argument("--out", default=str(ROOT / "bench" / "gpu-results"), help="Where results go.")
    parser.add_argument("--only", help="Comma-separated check names (a rerun of the ones that failed).")
    parser.add_argument("--hold-lease", metavar="REDIS_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold_lease:
        return hold_lease(args.hold_lease)
    if args.dry_run:
        return dry_run(args.json)
    return run_all(Path(args.out), set(args.only.split(",")) if args.only else None)


if __name__ == "__main__":
    sys.exit(main())
