"""Storage modes measured: one target's answers, generated once, trained offline, hybrid and online through the real
vLLM extraction service, each drafter's acceptance measured by vLLM itself.

  .venv/bin/python bench/storage_modes.py --target tiny        (then --target smollm2; --help: every option)

What it does, in its own Redis, file store and work directory (--work), with the vLLM of EYRIE_VLLM_COMMAND (default
the project's .venv-vllm, vLLM's CPU build here): vLLM serves the target while eyrie generates answers to --prompts
prompts (run `g`), which are cloned into runs `offline`, `hybrid` and `online` (the same shard objects, as
tests/e2e/test_storage_modes.py does). vLLM's extraction service (CPU-safe connector) extracts each with `eyrie extract
--storage MODE` (hybrid: a budget of half the offline run's stored bytes), and `eyrie train` + `eyrie worker train`
train each the same way (epochs, lr, seq len, draft vocabulary, held-out samples; speculators' default seed): hybrid
and online while the service runs (training asks it for the states not stored), offline after it is stopped (it
needs none). Per mode: the bucket bytes of its extract objects, the high-water mark of the trainer's cache directory +
the service's shared directory (sampled every --sample-s while the train task runs), the service's requests during
training (its /metrics vllm:request_success_total) and CPU seconds, the wall time of each epoch (the train task's live
progress: training loop started, each epoch's checkpoint stored). Then vLLM serves the target alone, and with each
exported drafter (eagle3, K), on --verify-prompts held-out prompts (the same samples in every mode), greedy
(learning_curve.verify_all, as `eyrie verify`). Writes --out (JSON, one entry per target), an SVG chart beside it and
the section of --results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.data.store import open_store
from eyrie.stages import TRAIN
from eyrie.work.extract_server import on_demand
from eyrie_trainer.data import done_samples, heldout_ids
from eyrie_trainer.export import download
from eyrie_trainer.verify import Served, serve_flags
from tests.support.processes import start_redis, stop

import learning_curve as lc
from results import write_section
from storage_processes import BIN, ROOT, Monitor, Service, Target, eyrie, model_path
from storage_report import acceptance_error, chart, epoch_walls, expected_requests, prompt_slice, section, summary

MODES = ("offline", "hybrid", "online")
SOURCE = "g"  # the generated run the three are cloned from


TARGETS = {
    # the tiny synthetic target (`make tiny-target`) on its own corpus, as examples/run.tiny.vllm.yaml
    "tiny": Target("assets/tiny-target", "tests/data/tiny_train_prompts.jsonl", 1, 96, 64, "2,4,5", 320,
                   "--enforce-eager", (), 256, 3e-3, 500, 8),
    # SmolLM2-135M-Instruct (`make smollm2`) on bench/run.smollm2-slice.yaml's rows (every 12th of the training mix)
    "smollm2": Target("assets/smollm2-135m-instruct", "assets/prompts/train-mix.jsonl", 12, 48, 96, "2,15,27", 512,
                      "--enforce-eager --dtype bfloat16", ("--temperature", "0.2", "--top-p", "0.9"), 1024, 3e-4,
                      8192, 8),
}


def train(run: str, a, t: Target, work: Path, conn, service: Service | None) -> dict:
    """`eyrie train` + one `eyrie worker train --burst` with a cache of its own, measured."""
    cache = work / f"cache-{run}"
    shutil.rmtree(cache, ignore_errors=True)
    eyrie("train", "--run", run, "--epochs", str(a.epochs), "--seq-len", str(t.seq_len), "--lr", str(t.lr),
          "--draft-vocab", str(t.draft_vocab), "--heldout", str(t.heldout), "--ttt-steps", str(a.k))
    requests_before, cpu_before = (service.requests_served(), service.cpu_s()) if service else (0, 0.0)
    monitor = Monitor(conn, run, cache, service.shared if service else None, a.sample_s)
    monitor.start()
    os.environ["EYRIE_CACHE_DIR"] = str(cache)  # the worker's
    try:
        task_s = train_worker(conn, run, work / f"worker-{run}.log")
    finally:
        os.environ["EYRIE_CACHE_DIR"] = str(work / "cache")
        monitor.stop.set()
        monitor.join()
    status = json.loads(subprocess.run([str(BIN / "eyrie"), "status", run, "--json"], capture_output=True,
                                       text=True).stdout)["stages"]["train"]
    if status.get("state") != "done":
        raise SystemExit(f"run {run}: training did not finish: {status}")
    return {"task_s": task_s, "peak_bytes": monitor.peak, "peak_state_bytes": monitor.peak_states,
            "disk_samples": monitor.samples, "load_1m": monitor.load / max(1, monitor.samples),
            "service_running": service is not None,
            "service_requests": service.requests_served() - requests_before if service else 0,
            "service_cpu_s": service.cpu_s() - cpu_before if service else 0.0, "notes": status.get("notes", []),
            **epoch_walls(monitor.loop_started, monitor.checkpoints, monitor.ended, a.epochs)}


def train_worker(conn, run: str, log: Path, grace_s: float = 15) -> float:
    """`eyrie worker train --burst` until its task has ended; the task's seconds (RQ's start to end). A burst worker
    whose RQ scheduler was forked after speculators trained in the process inherits speculators' SIGTERM handler
    and never exits (the scheduler ignores the worker's SIGTERM): once the task has ended and `grace_s` passed, the
    worker's process group is killed."""
    proc = subprocess.Popen([str(BIN / "eyrie"), "worker", "train", "--burst"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    job, ended_at = f"rq:job:{TRAIN.task_id(run, 0)}", None
    while proc.poll() is None:
        if ended_at is None and conn.hget(job, "status") in (b"finished", b"failed", b"stopped", b"canceled"):
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > grace_s:
            print(f"worker train ({run}): its task ended {grace_s:g} s ago and it has not exited: killed", flush=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(0.5)
    fields = {k.decode(): v.decode() for k, v in conn.hgetall(job).items()
              if k in (b"status", b"started_at", b"ended_at")}
    if fields.get("status") != "finished":
        raise SystemExit(f"run {run}: the train task ended {fields}: {log.read_text(errors='replace')[-3000:]}")
    when = lambda key: dt.datetime.fromisoformat(fields[key].replace("Z", "+00:00"))  # noqa: E731
    return (when("ended_at") - when("started_at")).total_seconds()


def generate(a, t: Target, settings, store, work: Path) -> float:
    """The prompts answered by the target in vLLM (run `g`, two shards), cloned into one run per mode."""
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(prompt_slice((ROOT / t.dataset).read_text().splitlines(keepends=True),
                                            a.prompts, t.stride)))
    started = time.monotonic()
    with Served(settings, model_path(t), serve_flags(settings, None), work / "generate-vllm.log") as server:
        os.environ["EYRIE_INFERENCE_URL"] = server.url
        os.environ["EYRIE_MODEL"] = str(model_path(t))  # the target named: that server does not say which it is
        eyrie("generate", "--dataset", str(prompts), "--run", SOURCE, "--concurrency", "16", "--max-tokens",
              str(a.max_tokens), "--shard-size", str(math.ceil(a.prompts / 2)), *t.sampling)
        eyrie("worker", "generate", "--burst")
    source, shards = Layout(SOURCE), load_run_manifest(store, SOURCE).generate_shards
    counts = [store.get_json(source.generate_shard_manifest(s.index)) for s in shards]
    if sum(c["counts"]["done"] for c in counts) < a.prompts:
        raise SystemExit(f"generation answered fewer than {a.prompts}: "
                         f"{[(c['counts'], c['failure_errors']) for c in counts]}")
    for run in MODES:
        store.put_json(Layout(run).manifest, {**store.get_json(source.manifest), "run": run})
        for shard in shards:
            store.put_json(Layout(run).generate_shard_manifest(shard.index),
                           {**store.get_json(source.generate_shard_manifest(shard.index)), "run": run})
    return time.monotonic() - started


def extract(store, run: str, t: Target, service: Service, *storage: str) -> dict:
    before = service.requests_served()
    wall = eyrie("extract", "--run", run, "--backend", "vllm", "--layers", t.layers, "--max-length",
                 str(t.max_model_len - 1), *storage)
    wall += eyrie("worker", "extract", "--burst")
    if not done_samples(store, run):
        raise SystemExit(f"run {run}: extraction stored no sample (read {service.log})")
    return {"extract_s": wall, "extract_requests": service.requests_served() - before}


def stored(store, run: str, heldout: int, epochs: int) -> dict:
    samples = done_samples(store, run)
    held = heldout_ids(samples, heldout)
    return {"stored_bytes": sum(s["bytes"] for s in samples), "samples": len(samples),
            "samples_with_states": sum(1 for s in samples if not on_demand(s)),
            "tokens": sum(s["seq_len"] for s in samples), "expected_requests": expected_requests(samples, held, epochs)}


def acceptance(store, settings, a, t: Target, work: Path) -> tuple[dict, dict]:
    """vLLM: the target alone, then each mode's exported drafter, on the held-out prompts."""
    drafters = {}
    for run in MODES:
        download(store, run, folder := work / "drafters" / run)
        drafters[run] = folder
    ns = SimpleNamespace(run="offline", prompts=a.verify_prompts, bench="", max_tokens=a.verify_tokens, k=a.k)
    _, alone, verified = lc.verify_all(settings, store, ns, load_run_manifest(store, "offline"), drafters,
                                       work / "verify")
    out = {}
    for run, v in verified.items():
        h = v["sets"][lc.HELDOUT]
        out[run] = {"length": h["vllm_acceptance_length"], "drafts": h["vllm_drafts"],
                    "per_position": h["vllm_per_position_acceptance"], "identical_outputs": h["identical_outputs"],
                    "speedup_1": h["speedup"]["1"], "verify_s": v["verify_s"],
                    "error": acceptance_error(h["vllm_acceptance_length"], h["vllm_per_position_acceptance"],
                                              h["vllm_drafts"])}
    return out, alone[lc.HELDOUT]


def measure(a, t: Target, work: Path) -> dict:
    settings = load_settings()
    store, result = open_store(settings), {"modes": {run: {} for run in MODES}}
    result["generate_s"] = generate(a, t, settings, store, work)
    service = Service(t, settings, work)
    try:
        os.environ["EYRIE_EXTRACT_VLLM_URL"] = service.url
        modes = result["modes"]
        modes["offline"] |= extract(store, "offline", t, service, "--storage", "offline")
        budget = stored(store, "offline", t.heldout, a.epochs)["stored_bytes"] // 2
        modes["hybrid"] |= extract(store, "hybrid", t, service, "--storage", "hybrid", "--budget", f"{budget}B")
        modes["online"] |= extract(store, "online", t, service, "--storage", "online")
        conn = __import__("redis").Redis.from_url(settings.redis_url)
        for run in ("hybrid", "online"):
            print(f"training {run} (the service running)", flush=True)
            modes[run] |= train(run, a, t, work, conn, service)
    finally:
        service.stop()
    print("training offline (the service stopped)", flush=True)
    modes["offline"] |= train("offline", a, t, work, conn, None)
    for run in MODES:
        drafter = store.get_json(Layout(run).drafter_manifest)
        modes[run] |= stored(store, run, t.heldout, a.epochs) | {
            "eyrie_tau": drafter.get("tau"), "drafter_sha256": drafter["files"]["model.safetensors"]["sha256"]}
    modes["hybrid"]["budget_bytes"] = budget
    print("vLLM acceptance of each drafter", flush=True)
    figures, result["target_tokens_per_s"] = acceptance(store, settings, a, t, work)
    for run in MODES:
        modes[run]["acceptance"] = figures[run]
    result["modes"] = {run: modes[run] for run in MODES}
    return result


def vllm_version(settings) -> str:
    done = subprocess.run([settings.vllm_command, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "?"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=list(TARGETS), help="required unless --render")
    p.add_argument("--prompts", type=int, help="prompts answered (default: the target's)")
    p.add_argument("--max-tokens", type=int, help="answer length when generating (default: the target's)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="draft length trained and served")
    p.add_argument("--verify-prompts", type=int, default=8, help="held-out prompts vLLM answers")
    p.add_argument("--verify-tokens", type=int, default=64, help="answer length in vLLM's acceptance pass")
    p.add_argument("--sample-s", type=float, default=0.2, help="how often the disk is sampled while training")
    p.add_argument("--work", type=Path, default=ROOT / ".eyrie" / "bench" / "storage-modes")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "storage_modes.json")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--render", action="store_true", help="only the chart and the section again, from --out")
    a = p.parse_args(argv)
    if not a.target and not a.render:
        p.error("--target is required (unless --render)")
    if a.target:
        t = TARGETS[a.target]
        a.prompts, a.max_tokens = a.prompts or t.prompts, a.max_tokens or t.max_tokens
    a.command = "python bench/storage_modes.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.render:
        return render(a, json.loads(a.out.read_text()))
    t, work = TARGETS[a.target], a.work / a.target
    if not (ROOT / t.model / "config.json").exists():
        raise SystemExit(f"{t.model} is missing: `make {'tiny-target' if a.target == 'tiny' else 'smollm2'}`")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.chdir(ROOT)
    redis_proc, redis_url = start_redis(work / "redis")
    try:
        os.environ.update({"EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"file://{work / 'store'}",
                           "EYRIE_CACHE_DIR": str(work / "cache"), "EYRIE_DEVICE": "cpu", "EYRIE_MODEL": model_path(t),
                           "EYRIE_VLLM_COMMAND": os.environ.get("EYRIE_VLLM_COMMAND",
                                                                str(ROOT / ".venv-vllm" / "bin" / "python")),
                           "EYRIE_MAX_MODEL_LEN": str(t.max_model_len), "EYRIE_VLLM_ARGS": t.vllm_args,
                           "EYRIE_SERVE_DEADLINE_S": "900", "VLLM_CPU_KVCACHE_SPACE": "1",
                           "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"})
        started = time.monotonic()
        measured = measure(a, t, work)
    finally:
        stop(redis_proc, timeout=30)
    settings = load_settings()
    result = {"target": a.target, "model": t.model, "command": a.command, **lc.machine(), "device": "cpu",
              "vllm": vllm_version(settings), "settings": asdict(t), "prompts": a.prompts, "max_tokens": a.max_tokens,
              "heldout": t.heldout, "epochs": a.epochs, "k": a.k, "lr": t.lr, "seq_len": t.seq_len,
              "draft_vocab": t.draft_vocab, "verify_prompts": a.verify_prompts, "verify_tokens": a.verify_tokens,
              "total_s": time.monotonic() - started, **measured}
    everything = json.loads(a.out.read_text()) if a.out.exists() else {"targets": {}}
    if previous := everything["targets"].get(a.target):
        result["earlier"] = previous.get("earlier", []) + [summary(previous)]
    everything["targets"][a.target] = result
    render(a, everything)


def render(a, everything: dict) -> None:
    """The JSON, the chart beside it and the RESULTS.md section."""
    everything["targets"] = {n: everything["targets"][n] for n in TARGETS if n in everything["targets"]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(everything, indent=2, default=str))
    svg = a.out.with_suffix(".svg")
    svg.write_text(chart(everything))
    write_section(a.results, section(everything, os.path.relpath(svg, a.results.parent)))
    print("\n".join(section(everything)))


if __name__ == "__main__":
    main()
