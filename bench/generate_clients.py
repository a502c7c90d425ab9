"""generate_throughput's clients, each against a fresh stub: eyrie (plan, then a burst worker), speculators'
`regenerate-responses`, the bare floor (bench/bare_client.py), a variant of eyrie; and eyrie's task under cProfile."""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import re
import shutil
import sys
import time
from pathlib import Path

import psutil

from tests.support.processes import stop

from generate_ruler import BIN, ROOT, busy_cpu_s, run_timed, server_side, start_stub


TINY = ROOT / "assets" / "tiny-target"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
CLIENTS = ("eyrie", "speculators", "bare", "variant")


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
