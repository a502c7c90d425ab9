"""Generation tok/s of vLLM's CPU build serving SmolLM2 (issue 28 item 4), per thread setting and
number of requests in flight: vLLM started as `eyrie serve` starts it (eyrie.core.vllm), one setting
at a time, then the first GSM8K-train prompts of the training mix at each in-flight count, greedy.
Prints one JSON line per (setting, in flight) and a markdown table to paste into bench/RESULTS.md.

  .venv/bin/python bench/vllm_cpu_threads.py --in-flight 32,64,128 --requests 128 --max-tokens 128

The settings: `default` (vLLM's own choice: it reduces torch to one thread for serving unless
OMP_NUM_THREADS is set), `omp=N` (OMP_NUM_THREADS=N), `bind=0-1` (VLLM_CPU_OMP_THREADS_BIND, the
engine's OpenMP threads pinned to those cores; with OMP_NUM_THREADS set to their count)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import aiohttp

from eyrie.core.vllm import serve_argv, serve_env, start_server, stop_server
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "assets" / "smollm2-135m-instruct"
PROMPTS = ROOT / "assets" / "prompts" / "train-mix.jsonl"


def setting_env(setting: str) -> dict[str, str]:
    if setting == "default":
        return {"VLLM_CPU_OMP_THREADS_BIND": "auto"}  # vLLM's own default (eyrie pins by default since issue 28)
    name, value = setting.split("=", 1)
    if name == "omp":
        return {"OMP_NUM_THREADS": value, "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    if name == "bind":
        first, last = (int(v) for v in value.split("-"))
        return {"VLLM_CPU_OMP_THREADS_BIND": value, "OMP_NUM_THREADS": str(last - first + 1)}
    raise SystemExit(f"unknown setting {setting!r}: default, omp=N or bind=A-B")


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:n]]
    return [row["conversations"][0]["content"] for row in rows]


def start(setting: str, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    cmd = [*serve_argv(str(ROOT / ".venv-vllm" / "bin" / "python"), str(MODEL)), "--port", str(port),
           "--max-model-len", "2048"]
    env = {**serve_env(), "HF_HUB_OFFLINE": "1", **setting_env(setting)}  # as eyrie serve's, plus the setting
    started = time.monotonic()
    proc = start_server(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    import requests

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM ({setting}) exited: {log.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).ok:
                return proc, time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(1)


async def measure(port: int, texts: list[str], in_flight: int, max_tokens: int) -> dict:
    """Every prompt once, at most `in_flight` at a time: completion tokens over the wall."""
    gate = asyncio.Semaphore(in_flight)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def one(session, text: str) -> int:
        async with gate:
            body = {"model": str(MODEL), "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens, "temperature": 0}
            async with session.post(url, json=body) as response:
                return (await response.json())["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(session, t) for t in texts)))
        wall = time.monotonic() - started
    return {"requests": len(texts), "tokens": tokens, "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="default,omp=2,bind=0-1")
    p.add_argument("--in-flight", default="32,64,128")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--logs", type=Path, default=Path("/tmp/vllm-threads"))
    args = p.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    texts, rows = prompts(args.requests), []
    for setting in args.settings.split(","):
        port = free_port()
        proc, startup = start(setting, port, args.logs / f"{setting.replace('=', '-')}.log")
        try:
            asyncio.run(measure(port, texts[:8], 8, 16))  # warm-up, not counted
            for n in (int(v) for v in args.in_flight.split(",")):
                row = {"setting": setting, "in_flight": n, "startup_s": round(startup, 1),
                       **asyncio.run(measure(port, texts, n, args.max_tokens))}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            stop_server(proc)
    base = {r["in_flight"]: r["tok_s"] for r in rows if r["setting"] == rows[0]["setting"]}
    print(f"\nMachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; SmolLM2-135M-Instruct, "
          f"{args.requests} GSM8K-train prompts, greedy, max_tokens {args.max_tokens}\n")
    print("| setting | in flight | tok/s | vs " + rows[0]["setting"] + " | wall s | start-up s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['in_flight']} | {r['tok_s']} | {r['tok_s'] / base[r['in_flight']]:.2f}x | "
              f"{r['wall_s']} | {r['startup_s']} |")


if __name__ == "__main__":
    main()
