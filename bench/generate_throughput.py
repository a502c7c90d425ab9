"""Generate-stage throughput: eyrie's generator vs speculators' `regenerate-responses`, same stub.

Run on demand (not a test):  make bench   or   .venv/bin/python bench/generate_throughput.py

For each latency (1.0 s and 0.05 s by default), each client and each repeat, a fresh vLLM
stand-in (tests/support/stub_openai.py, wrapped by bench/timed_stub.py) answers N distinct prompts with
T-token answers carrying reasoning and token ids. Every client is measured with the same ruler,
at the server:

  requests/s      answered requests / (last answer - first arrival)
  mean in flight  time-weighted requests inside the server's handler over that window
  client CPU      user+system of the client's whole process tree per 1000 requests: inside the
                  request window (psutil samples, same monotonic clock as the stub) and end to end
                  (os.wait4 of the command; eyrie: the RQ worker, its work horse and scheduler)

Clients:
  eyrie        `eyrie generate --dataset F --run R --concurrency C --max-tokens T --shard-size N`
               (plan: inputs to the store, one task), then `eyrie worker generate --burst`
               (answers; parts and the finished shard go to a file store), EYRIE_SERVER=vllm.
  speculators  `speculators regenerate-responses --endpoint URL --model <tiny target> --dataset F
               --limit N --concurrency C --max-tokens T --outfile O` (0.9.0).
  bare         bench/bare_client.py: aiohttp + orjson.loads, nothing kept: the floor of a
               one-process asyncio client on this machine (reference only).
  variant      with --variant DIR: eyrie again, with DIR first on PYTHONPATH (a modified copy of
               eyrie_generator, say), to measure a proposed change side by side.

Writes bench/RESULTS.md (unless --no-write). --profile adds a cProfile of eyrie's ShardRunner,
run in-process against a stub at the lowest latency.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from eyrie.core.stage_settings import GenerateSettings
from tests.support.processes import start_redis, stop

from generate_clients import CLIENTS, OFFLINE, Bench, write_prompts
from generate_report import goals, medians, summarize, table, where_table, write_results
from generate_ruler import ROOT, busy_cpu_s

SNAPSHOT = "GENERATE_THROUGHPUT_SNAPSHOT"  # the snapshot's folder and description, for the process use_snapshot starts


def machine() -> dict:
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from importlib.metadata import version

    pkgs = ", ".join(f"{p} {version(p)}" for p in ("aiohttp", "orjson", "rq", "redis", "speculators"))
    return {"line": f"{os.cpu_count()} vCPU ({model}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
                    f"Python {platform.python_version()}, {platform.system()} {platform.release()}",
            "packages": pkgs, "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def use_snapshot(ref: str, tmp: Path) -> None:
    """Measure a commit instead of the working tree (which may be mid-edit): `git archive` it into tmp and
    start this script again with it first on PYTHONPATH, for its own imports and everything it starts (the
    new process finds tmp and the code's description in SNAPSHOT). Does not return."""
    sha = git("rev-parse", "--short", ref)
    if not sha:
        sys.exit(f"unknown git ref {ref!r}")
    code = tmp / "code"
    code.mkdir()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    paths = [str(code), str(code / "services" / "generator")]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    found = subprocess.run([sys.executable, "-c", "import eyrie, eyrie_generator; "
                            "print(eyrie.__file__, eyrie_generator.__path__[0])"],
                           cwd=tmp, capture_output=True, text=True).stdout.split()
    if len(found) != 2 or not all(f.startswith(str(code)) for f in found):
        sys.exit(f"the snapshot does not shadow the installed eyrie: {found}")
    os.environ[SNAPSHOT] = json.dumps({"tmp": str(tmp), "code": f"eyrie at commit {sha} (`git archive` of {ref}; "
                                                                 "the working tree was not used)"})
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


def code_state() -> str:
    """The eyrie code measured: commit, and the uncommitted files of eyrie, if any."""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "eyrie", "services"], cwd=ROOT,
                           capture_output=True, text=True).stdout.splitlines()
    if not dirty:
        return f"eyrie at commit {head}"
    import hashlib

    digest = hashlib.sha256(git("diff", "HEAD", "--", "eyrie", "services").encode()).hexdigest()[:12]
    return (f"eyrie at commit {head} plus uncommitted changes to {', '.join(line[3:] for line in dirty)} "
            f"(diff sha256 {digest})")


def idle_check(seconds: float = 2.0) -> float:
    """Cores busy with other work before the benchmark starts."""
    b0 = busy_cpu_s()
    time.sleep(seconds)
    return (busy_cpu_s() - b0) / seconds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latencies", type=float, nargs="+", default=[1.0, 0.05])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=GenerateSettings.model_fields["concurrency"].default,
                        help="Requests in flight (default: eyrie's generate.concurrency).")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=1, help="User turns a row (each answered in order: one "
                                                             "request a turn); a section of its own in RESULTS.md.")
    parser.add_argument("--shard-size", type=int, default=500,
                        help="eyrie's rows per shard (0: one shard); several shards show the lanes moving on.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per client and latency (medians shown).")
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS[:3]), choices=CLIENTS)
    parser.add_argument("--variant", metavar="DIR", help="Also run eyrie with DIR first on PYTHONPATH.")
    parser.add_argument("--timeout", type=float, default=240, help="Per client run, seconds.")
    parser.add_argument("--profile", action="store_true", help="Add a cProfile of eyrie's task.")
    parser.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--keep", action="store_true", help="Keep the temporary directory.")
    parser.add_argument("--snapshot", metavar="REF",
                        help="Measure this commit (git archive) instead of the working tree.")
    parser.add_argument("--nice", type=int, default=0,
                        help="Niceness increment for the benchmark and everything it starts; negative "
                             "(root only) puts it ahead of other work on a shared machine.")
    args = parser.parse_args()
    if args.turns > 1 and "bare" in args.clients:  # one request a row: no floor for a conversation
        args.clients.remove("bare")
    if args.variant and "variant" not in args.clients:
        args.clients.append("variant")
    if "variant" in args.clients and not args.variant:
        parser.error("--clients variant needs --variant DIR")
    return args


def measure(args, tmp: Path, redis_proc, redis_url: str) -> tuple[list[dict], str | None]:
    """Every client at every latency, `repeat` times, the order rotating; the profile if asked."""
    prompts = write_prompts(tmp / "prompts.jsonl", args.prompts, args.turns)
    bench = Bench(args, tmp, redis_url, redis_proc.pid, prompts)
    rows = []
    for latency in args.latencies:
        for i in range(args.repeat):
            order = args.clients[i % len(args.clients):] + args.clients[:i % len(args.clients)]
            for client in order:
                r = summarize(bench.run(client, latency))
                rows.append(r)
                print(f"{latency:g} s #{i + 1} {client:>11}: {r['req_per_s']:6.1f} req/s, "
                      f"{r['mean_in_flight']:5.1f} in flight; CPU s/1000 req {r['window_cpu_per_1000']:.2f} in "
                      f"window, {r['cpu_per_1000']:.2f} end to end; {r['wall_s']:.1f} s wall; other load "
                      f"{r['other_load']:.2f} cores; {r['check']}", flush=True)
    return rows, bench.profile(min(args.latencies)) if args.profile else None


def main() -> None:
    args = parse_args()
    snapshot = json.loads(os.environ.pop(SNAPSHOT, "null"))  # set where use_snapshot started this process
    if args.nice and not snapshot:
        os.nice(args.nice)
    tmp = Path(snapshot["tmp"]) if snapshot else Path(tempfile.mkdtemp(prefix="eyrie-bench-"))
    if args.snapshot and not snapshot:
        use_snapshot(args.snapshot, tmp)
    info = machine()
    info["code"] = snapshot["code"] if snapshot else code_state()
    print(f"machine: {info['line']}; {info['packages']}; {info['date']}\ncode: {info['code']}", flush=True)
    info["idle_load"] = idle_check()
    if info["idle_load"] > 0.15:
        print(f"WARNING: {info['idle_load']:.2f} cores busy with other work before the start: "
              "results will be noisy", flush=True)
    redis_proc, redis_url = start_redis(tmp / "redis")
    os.environ.update(OFFLINE)
    t_start = time.monotonic()
    try:
        rows, prof = measure(args, tmp, redis_proc, redis_url)
    finally:
        stop(redis_proc)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - t_start
    med = medians(rows)
    print(f"\n{table(med)}\n\n{where_table(med, args.concurrency)}")
    checks = goals(med, args.concurrency) if {"eyrie", "speculators"} <= set(args.clients) else []
    for name, ok, value in checks:
        print(f"{'MET ' if ok else 'MISS'}  {name}: {value}")
    if not args.no_write:
        write_results(Path(args.out), args, info, med, rows, checks, prof, total)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
