"""Generate-stage throughput: eyrie's generator vs speculators' `regenerate-responses`, same stub.

Run on demand (not a test):  make bench   or   .venv/bin/python bench/generate_throughput.py

For each latency (1.0 s and 0.05 s by default), each client and each repeat, a fresh vLLM
stand-in (tests/stub_openai.py, wrapped by bench/timed_stub.py) answers N distinct prompts with
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
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY = ROOT / "assets" / "tiny-target"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
CLIENTS = ("eyrie", "speculators", "bare", "variant")
GOAL_IN_FLIGHT = 0.98  # issue 14: mean in flight >= 0.98*C over 2,000 requests at 1 s


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            get_json(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if not binary:
        sys.exit("redis-server is not installed (make redis)")
    port = free_port()
    (tmp / "redis").mkdir()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp / "redis")], stdout=subprocess.DEVNULL)
    import redis

    conn = redis.Redis(port=port)
    for _ in range(200):
        try:
            conn.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_stub(latency: float, tokens: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "timed_stub.py"), "--port", str(port),
                             "--latency", str(latency), "--shape", "reasoning", "--tokens", str(tokens)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    return proc, url


class TreeSampler(threading.Thread):
    """CPU seconds of a process tree, sampled every `period` s on the system-wide monotonic clock
    (the stub's clock too), so the CPU spent inside the server's request window can be read."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period, self.samples = pid, period, []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.done.is_set():
            try:
                t = root.cpu_times()
                total = t.user + t.system + t.children_user + t.children_system  # + reaped children
                for child in root.children(recursive=True):
                    try:
                        c = child.cpu_times()
                        total += c.user + c.system
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), total))
            self.done.wait(self.period)

    def cpu_between(self, t0: float, t1: float) -> float | None:
        if len(self.samples) < 2 or not (self.samples[0][0] <= t0 and t1 <= self.samples[-1][0]):
            return None
        return self._at(t1) - self._at(t0)

    def _at(self, t: float) -> float:
        for (ta, ca), (tb, cb) in zip(self.samples, self.samples[1:]):
            if ta <= t <= tb:
                return ca + (cb - ca) * (t - ta) / max(1e-9, tb - ta)
        return self.samples[-1][1]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), steal included."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def run_timed(cmd: list[str], env: dict, log: Path, timeout: float, sample: bool = False) -> dict:
    """Run a command; wall seconds and the CPU of its whole (reaped) process tree via wait4."""
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid) if sample else None
        if sampler:
            sampler.start()
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            if sampler:
                sampler.done.set()
                sampler.join()
        wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} (killed after {timeout:.0f} s?):\n"
                           f"{log.read_text(errors='replace')[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024,
            "sampler": sampler}


def write_prompts(path: Path, n: int, turns: int = 1) -> Path:
    """ShareGPT rows of `turns` user turns (a placeholder answer between them, which both clients drop and
    regenerate), every user turn distinct (the stub counts requests per last user turn)."""
    topics = ["rivers", "prime numbers", "sourdough", "compilers", "glaciers", "chess openings",
              "photosynthesis", "TCP congestion control", "the Roman calendar", "bird migration"]
    with path.open("w") as f:
        for i in range(n):
            row = []
            for t in range(turns):
                ask = "explain" if t == 0 else f"(turn {t + 1}) say more about"
                row += [{"from": "gpt", "value": "a dataset answer, never asked"}] if t else []
                row.append({"from": "human", "value": f"Prompt {i:05d}: {ask} {topics[i % len(topics)]} to a "
                                                      "curious student, step by step."})
            f.write(json.dumps({"conversations": row}) + "\n")
    return path


def server_side(url: str, n: int, concurrency: int) -> dict:
    stats = get_json(f"{url}/bench-stats?events=1")
    counts = get_json(f"{url}/stats")["requests"]
    stats["each_once"] = len(counts) == n and all(v == 1 for v in counts.values())
    stats["req_per_s"] = stats["answered"] / stats["window_s"] if stats["window_s"] else 0.0
    stats.update(losses(stats.pop("events"), concurrency))
    return stats


def losses(events: list, c: int) -> dict:
    """Where the window's C slots stood empty, in seconds of all C slots: before C requests had
    first arrived (ramp), after the last arrival (tail: the last answers trickle in), and between
    (turnaround: an answer left the handler, the client's next request had not yet arrived)."""
    events = sorted(events)
    if not events:
        return {"loss_ramp_s": 0.0, "loss_turnaround_s": 0.0, "loss_tail_s": 0.0}
    last_arrival = max(t for t, d in events if d > 0)
    lost = {"ramp": 0.0, "turnaround": 0.0, "tail": 0.0}
    in_flight, arrivals, prev = 0, 0, events[0][0]
    for t, d in events:
        phase = "ramp" if arrivals < c else ("tail" if prev >= last_arrival else "turnaround")
        lost[phase] += max(0, c - in_flight) * (t - prev)
        in_flight += d
        arrivals += d > 0
        prev = t
    return {f"loss_{k}_s": v / c for k, v in lost.items()}


# --------------------------------------------------------------------------- clients

class Bench:
    def __init__(self, args, tmp: Path, redis_url: str, redis_pid: int, prompts: Path):
        self.args, self.tmp, self.redis_url, self.prompts = args, tmp, redis_url, prompts
        self.redis_proc = psutil.Process(redis_pid)
        self.store_url = f"file://{tmp / 'store'}"
        self.seq = 0

    def run(self, client: str, latency: float) -> dict:
        """One client against a fresh stub; also how busy the rest of the machine was meanwhile."""
        self.seq += 1
        stub, url = start_stub(latency, self.args.tokens)
        stub_ps = psutil.Process(stub.pid)
        before = (busy_cpu_s(), _cpu(stub_ps), _cpu(self.redis_proc), time.process_time(), time.monotonic())
        try:
            result = getattr(self, f"_{client}")(url)
            server = server_side(url, self.args.prompts * self.args.turns, self.args.concurrency)
            stub_cpu = _cpu(stub_ps) - before[1]
        finally:
            stop(stub)
        wall = time.monotonic() - before[4]
        ours = result["proc"]["cpu_s"] + (result.get("plan") or {}).get("cpu_s", 0) + stub_cpu \
            + _cpu(self.redis_proc) - before[2] + time.process_time() - before[3]
        other = max(0.0, busy_cpu_s() - before[0] - ours)
        return {"client": client, "latency": latency, "server": server, "stub_cpu_s": stub_cpu,
                "other_load": other / wall, **result}

    def _variant(self, url: str) -> dict:
        return self._eyrie(url, pythonpath=self.args.variant)

    def _eyrie(self, url: str, pythonpath: str | None = None) -> dict:
        run = f"bench{self.seq}"
        env = self.eyrie_env(url)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        plan = self.plan(run, env)
        worker = run_timed([str(BIN / "eyrie"), "worker", "generate", "--burst"], env,
                           self.tmp / f"{run}-worker.log", timeout=self.args.timeout, sample=True)
        job = self.job_result(run)
        return {"plan": plan, "proc": worker, "check": self.check_shard(run),
                "own": {k: job.get(k) for k in ("wall_s", "mean_in_flight", "done", "failed")}}

    def eyrie_env(self, stub_url: str) -> dict:
        return {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": self.redis_url, "EYRIE_STORE_URL": self.store_url,
                "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY), "EYRIE_INFERENCE_URL": stub_url}

    def plan(self, run: str, env: dict) -> dict:
        a = self.args
        return run_timed([str(BIN / "eyrie"), "generate", "--dataset", str(self.prompts), "--run", run,
                          "--concurrency", str(a.concurrency), "--max-tokens", str(a.tokens),
                          "--shard-size", str(a.shard_size or a.prompts)], env, self.tmp / f"{run}-plan.log",
                         timeout=120)

    def job_result(self, run: str) -> dict:
        import redis
        from rq.job import Job
        from rq.serializers import JSONSerializer

        job = Job.fetch(f"generate-{run}-00000", connection=redis.Redis.from_url(self.redis_url),
                        serializer=JSONSerializer)
        return job.return_value() or {}

    def check_shard(self, run: str) -> str:
        import orjson

        from eyrie.core.config import load_settings
        from eyrie.data.manifest import Layout
        from eyrie.data.store import open_store

        store = open_store(load_settings(store_url=self.store_url, redis_url=self.redis_url))
        shards = -(-self.args.prompts // (self.args.shard_size or self.args.prompts))
        manifests = [store.get_json(Layout(run).generate_shard_manifest(i)) for i in range(shards)]
        records = [orjson.loads(line) for m in manifests for line in store.get_bytes(m["object"]).splitlines()]
        bad = sum(1 for r in records if r["status"] != "done" or not r["reasoning"] or len(r.get("turns") or [r])
                  != self.args.turns or any(len(t["completion_token_ids"] or []) != self.args.tokens
                                            or t["prompt_token_ids"] != list(range(10)) for t in r.get("turns") or [r]))
        shutil.rmtree(self.tmp / "store" / "runs" / run, ignore_errors=True)  # keep the disk small
        return (f"{shards} shard(s) of {len(records)} records ({bad} bad), "
                f"{sum(m['bytes'] for m in manifests) / 1e6:.1f} MB")

    def speculators_max_tokens(self) -> int:
        """speculators 0.9 ends a conversation once prompt + answer pass its --max-tokens (a budget for the
        whole sequence): with several turns, room for every turn, the stub's answers being `tokens` long."""
        a = self.args
        return a.tokens if a.turns == 1 else a.turns * (a.tokens + 10 * a.turns) + 1

    def _speculators(self, url: str) -> dict:
        a = self.args
        out = self.tmp / f"spec{self.seq}" / "out.jsonl"
        log = self.tmp / f"spec{self.seq}.log"
        proc = run_timed([str(BIN / "speculators"), "regenerate-responses", "--endpoint", f"{url}/v1/chat/completions",
                          "--model", str(TINY), "--dataset", str(self.prompts), "--limit", str(a.prompts),
                          "--concurrency", str(a.concurrency), "--max-tokens", str(self.speculators_max_tokens()),
                          "--outfile", str(out)],
                         {**os.environ, **OFFLINE}, log, timeout=a.timeout, sample=True)
        text = log.read_text(errors="replace")
        own = re.search(r"Pipeline complete in ([\d.]+)s.*?Throughput: ([\d.]+) req/s", text, re.S)
        lines = out.read_text().splitlines() if out.exists() else []
        errors = out.with_name("out.errors.jsonl")
        n_err = len(errors.read_text().splitlines()) if errors.exists() else 0
        bad = sum(1 for line in lines if a.turns == 1 and len(json.loads(line)["input_ids"]) != 10 + a.tokens)
        size = out.stat().st_size / 1e6 if out.exists() else 0
        shutil.rmtree(out.parent, ignore_errors=True)
        return {"proc": proc, "check": f"outfile of {len(lines)} rows ({bad} bad, {n_err} errors), {size:.1f} MB",
                "own": {"wall_s": float(own.group(1)) if own else None,
                        "req_per_s": float(own.group(2)) if own else None}}

    def _bare(self, url: str) -> dict:
        a = self.args
        log = self.tmp / f"bare{self.seq}.log"
        proc = run_timed([sys.executable, str(ROOT / "bench" / "bare_client.py"), "--url", url, "--prompts",
                          str(self.prompts), "--concurrency", str(a.concurrency), "--max-tokens", str(a.tokens)],
                         {**os.environ}, log, timeout=a.timeout, sample=True)
        own = re.search(r"(\d+) done in ([\d.]+) s", log.read_text())
        return {"proc": proc, "check": f"{own.group(1) if own else '?'} answers parsed",
                "own": {"wall_s": float(own.group(2)) if own else None}}

    def profile(self, latency: float) -> str:
        """cProfile of eyrie's task in this process (ShardRunner through the RQ entry point)."""
        self.seq += 1
        run = f"bench{self.seq}"
        stub, url = start_stub(latency, self.args.tokens)
        saved = dict(os.environ)
        try:
            env = self.eyrie_env(url)
            self.plan(run, env)
            os.environ.update(env)
            from eyrie_generator.shard import run_generate_shard

            profiler = cProfile.Profile()
            t0, c0 = time.monotonic(), time.process_time()
            profiler.enable()
            result = run_generate_shard({"run": run, "shard": 0})
            profiler.disable()
            wall, cpu = time.monotonic() - t0, time.process_time() - c0
            server = server_side(url, self.args.prompts * self.args.turns, self.args.concurrency)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            stop(stub)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(20)
        stats.sort_stats("cumulative").print_stats(r"eyrie|shard|client|store", 25)
        head = (f"ShardRunner in-process under cProfile, stub latency {latency:g} s: task {wall:.2f} s wall, "
                f"{cpu:.2f} s CPU (profiler overhead included, about 2x on Python code); the server saw "
                f"{server['req_per_s']:.0f} req/s, {server['mean_in_flight']:.0f} in flight; "
                f"{result.get('done')} done\n")
        return head + _trim_pstats(text.getvalue())


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _trim_pstats(text: str) -> str:
    out = []
    for line in text.splitlines():
        line = line.replace(str(BIN.parent) + "/lib/python3.11/site-packages/", "").replace(str(ROOT) + "/", "")
        line = re.sub(r"/\S*/lib/python3\.\d+/", "", line)
        line = re.sub(r"/\S*/eyrie-bench-[^/]+/code/", "", line).rstrip()
        if line and not line.lstrip().startswith(("Ordered by", "List reduced")):
            out.append(line)
    return "\n".join(out)


# --------------------------------------------------------------------------- report

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


def use_snapshot(ref: str, tmp: Path) -> str:
    """Measure a commit instead of the working tree (which may be mid-edit): `git archive` it into
    tmp and put it first on the path of this process and of everything it starts."""
    sha = git("rev-parse", "--short", ref)
    if not sha:
        sys.exit(f"unknown git ref {ref!r}")
    code = tmp / "code"
    code.mkdir()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    paths = [str(code), str(code / "services" / "generator")]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    sys.path[:0] = paths
    found = subprocess.run([sys.executable, "-c", "import eyrie, eyrie_generator; "
                            "print(eyrie.__file__, eyrie_generator.__path__[0])"],
                           cwd=tmp, capture_output=True, text=True).stdout.split()
    if len(found) != 2 or not all(f.startswith(str(code)) for f in found):
        sys.exit(f"the snapshot does not shadow the installed eyrie: {found}")
    return f"eyrie at commit {sha} (`git archive` of {ref}; the working tree was not used)"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latencies", type=float, nargs="+", default=[1.0, 0.05])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=200)
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
    if args.nice:
        os.nice(args.nice)
    if args.turns > 1 and "bare" in args.clients:  # one request a row: no floor for a conversation
        args.clients.remove("bare")
    if args.variant and "variant" not in args.clients:
        args.clients.append("variant")
    if "variant" in args.clients and not args.variant:
        parser.error("--clients variant needs --variant DIR")

    tmp = Path(tempfile.mkdtemp(prefix="eyrie-bench-"))
    info = machine()
    info["code"] = use_snapshot(args.snapshot, tmp) if args.snapshot else code_state()
    print(f"machine: {info['line']}; {info['packages']}; {info['date']}\ncode: {info['code']}", flush=True)
    info["idle_load"] = idle_check()
    if info["idle_load"] > 0.15:
        print(f"WARNING: {info['idle_load']:.2f} cores busy with other work before the start: "
              "results will be noisy", flush=True)
    redis_proc, redis_url = start_redis(tmp)
    os.environ.update(OFFLINE)
    t_start = time.monotonic()
    rows, prof = [], None
    try:
        prompts = write_prompts(tmp / "prompts.jsonl", args.prompts, args.turns)
        bench = Bench(args, tmp, redis_url, redis_proc.pid, prompts)
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
        if args.profile:
            prof = bench.profile(min(args.latencies))
    finally:
        stop(redis_proc)
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - t_start

    med = medians(rows)
    print()
    print(table(med))
    print()
    print(where_table(med, args.concurrency))
    checks = goals(med, args.concurrency) if {"eyrie", "speculators"} <= set(args.clients) else []
    for name, ok, value in checks:
        print(f"{'MET ' if ok else 'MISS'}  {name}: {value}")
    if not args.no_write:
        write_results(Path(args.out), args, info, med, rows, checks, prof, total)
        print(f"wrote {args.out}")


def write_results(path: Path, args, info, med, rows, checks, prof, total) -> None:
    c, cmd = args.concurrency, " ".join(["python bench/generate_throughput.py", *sys.argv[1:]])
    load = max(r["other_load"] for r in rows)
    lines = [
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
        f"(tests/stub_openai.py, via bench/timed_stub.py) answers each request after a fixed latency with "
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
        "",
        "## Goals (from the issue)",
        "",
    ]
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
    # Only this script's section is replaced: the extract section below it is kept.
    old = path.read_text() if path.exists() else ""
    marker = "\n# Extract throughput\n"
    rest = old[old.index(marker):] if marker in old else ""
    path.write_text("\n".join(lines).rstrip("\n") + "\n" + rest)


if __name__ == "__main__":
    main()
