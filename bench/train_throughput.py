"""Train-stage throughput: eyrie's train task vs speculators' own `train` entry, same data, same argv.

Run on demand (not a test):  .venv/bin/python bench/train_throughput.py             (CPU, small random target)
  GPU (8B-shaped target): .venv/bin/python bench/train_throughput.py --device cuda --hidden 4096 --vocab 128256 \
      --layers 32 --samples 400 --seq-len 2048 --total-seq-len 8192 --draft-vocab 32000 --workers 4

Built in a temporary directory: a random Llama-shaped target (config, the tiny target's tokenizer, and only the
tensors speculators' drafter reads from a verifier: embed_tokens, lm_head, model.norm), a FileStore holding a real
eyrie run (run manifest with generate/extract params and the train plan from eyrie_trainer.plan; extract shard
manifests whose sample entries are what ExtractRunner._put/_finish write; per-sample files from
eyrie_extractor.shard.sample_tensors with random token ids and random bf16 hidden states [L, n_aux+1, H]) and a
redis-server of our own. TrainRunner._prepare_data materializes the run once; both sides then train on that
directory with the argv TrainRunner._argv builds (+ sdpa, eager loss), each in a fresh process, interleaved:
  eyrie  TrainRunner(settings, redis, store, run).run(), the real train task (restore, Redis progress per step,
         heartbeat, checkpoint upload after each epoch; evaluation and export follow, untimed)
  ref    CPU: speculators.train.cli.main(TrainConfig.resolve(argv)) under eyrie's device shim with no-op hooks
         (engine.train(argv, "cpu", Hooks())): the CLI as shipped calls CUDA. GPU: `speculators train ARGV`.
Measured the same way on both sides: speculators logs a dict per step on "speculators.metrics" (log-freq 1) right
after the optimizer step; tokens/s = tokens of steps 2..N (their `profile` counts) / time from step 1's record to
step N's: start-up, loader spawn and step 1 out; epoch boundaries (checkpoint save, validation, eyrie's upload) in.
In-process sides timestamp the records with a root logging handler; the literal CLI's printed records are
timestamped by this process as they arrive. Memory: CPU ru_maxrss of the training process (loader workers not
counted); GPU torch.cuda.max_memory_allocated (literal CLI: the largest memory_allocated in its step profiles).
"""

from __future__ import annotations

import argparse, datetime as dt, json, os, re, shutil, socket, statistics, subprocess, sys, tempfile, time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RUN = "bench-train"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}


def build(work: Path, a) -> None:
    """Target directory, store with the extracted run, train plan; materialized training data."""
    import torch
    from safetensors.torch import save, save_file
    from transformers import LlamaConfig

    from eyrie.manifest import (Counts, DatasetRef, ExtractParams, GenerateParams, Layout, RunManifest,
                                SamplingParams, ShardManifest, ShardPlan, TargetRef, code_version, now_iso)
    from eyrie.store import FileStore
    from eyrie_extractor.layers import default_aux_layers
    from eyrie_extractor.shard import sample_tensors
    from eyrie_trainer.plan import TrainRequest, _require_extract_done, plan

    target, g = work / "target", torch.Generator().manual_seed(0)
    target.mkdir()
    heads = a.hidden // 128 if a.hidden >= 2048 else a.hidden // 64
    LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 7 // 2, num_hidden_layers=a.layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=a.vocab,
                max_position_embeddings=max(8192, a.total_seq_len), rms_norm_eps=1e-5,
                tie_word_embeddings=False).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # speculators resolves the mask token from it
        shutil.copy(ROOT / "assets" / "tiny-target" / name, target / name)
    save_file({"model.embed_tokens.weight": torch.randn(a.vocab, a.hidden, generator=g, dtype=torch.bfloat16) * 0.02,
               "lm_head.weight": torch.randn(a.vocab, a.hidden, generator=g, dtype=torch.bfloat16) * 0.02,
               "model.norm.weight": torch.ones(a.hidden, dtype=torch.bfloat16)}, str(target / "model.safetensors"))
    store, layout, aux, size = FileStore(work / "store"), Layout(RUN), default_aux_layers(a.layers), 1000
    shards = [{r: f"{r:024x}" for r in range(start, min(a.samples, start + size))} for start in range(0, a.samples, size)]
    plans = []
    for index, ids in enumerate(shards):  # the generate input a plan points at: row and sample id per line
        info = store.put_bytes(layout.generate_input(index), "".join(
            json.dumps({"row": r, "sample_id": s}) + "\n" for r, s in ids.items()).encode())
        plans.append(ShardPlan(index=index, row_start=min(ids), row_end=max(ids) + 1, input_key=info.key,
                               input_sha256=info.sha256))
    manifest = RunManifest(
        run=RUN, created_at=now_iso(), code_version=code_version(), generate_shards=plans,
        target=TargetRef(model=str(target), revision="random", chat_template_sha256=None, server="transformers"),
        dataset=DatasetRef(source="synthetic", kind="jsonl", revision="0" * 64, row_end=a.samples),
        generate=GenerateParams(sampling=SamplingParams(max_tokens=a.seq_len), concurrency=200,
                                request_timeout_s=1800.0, max_retries=5, shard_size=size),
        extract=ExtractParams(backend="hf", aux_layers=aux, dtype="bf16", max_length=None, num_layers=a.layers,
                              hidden_size=a.hidden, samples=a.samples, tokens=a.samples * a.seq_len, truncated=0,
                              projected_bytes=a.samples * a.seq_len * (len(aux) + 1) * a.hidden * 2, budget_bytes=None))
    store.put_json(layout.manifest, manifest.model_dump())
    for index, ids in enumerate(shards):
        started, entries = now_iso(), []
        for row, sid in ids.items():
            tokens = torch.randint(0, a.vocab, (a.seq_len,), generator=g).tolist()
            states = torch.randn(a.seq_len, len(aux) + 1, a.hidden, generator=g, dtype=torch.bfloat16)
            info = store.put_bytes(layout.extract_sample(index, sid), save(sample_tensors(states, tokens, "bf16")))
            entries.append({"sample_id": sid, "row": row, "status": "done", "key": info.key, "sha256": info.sha256,
                            "bytes": info.size, "seq_len": a.seq_len, "prompt_len": a.seq_len // 4,
                            "source": "server", "mismatch": False, "truncated": False})
        counts = Counts(total=len(entries), done=len(entries), tokens=a.seq_len * len(entries),
                        bytes=sum(e["bytes"] for e in entries))
        store.put_json(layout.extract_shard_manifest(index), ShardManifest(
            run=RUN, stage="extract", shard=index, bytes=counts.bytes, counts=counts, skip_reasons={},
            failure_errors={}, started_at=started, finished_at=now_iso(), worker=socket.gethostname(),
            samples=entries).model_dump())
    _require_extract_done(store, manifest, layout)
    manifest.train = plan(store, manifest, TrainRequest(epochs=a.epochs, max_steps=a.max_steps,
                                                        draft_vocab=a.draft_vocab, total_seq_len=a.total_seq_len,
                                                        heldout=a.heldout), work / "cache")
    store.put_json(layout.manifest, manifest.model_dump())
    (work / "manifest.json").write_text(json.dumps(manifest.model_dump()))


def settings_env(work: Path, a, redis_url: str) -> dict:
    return {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"file://{work / 'store'}",
            "EYRIE_CACHE_DIR": str(work / "cache"), "EYRIE_DEVICE": a.device, "EYRIE_TRAIN_FAST_PATH": "off",
            "EYRIE_TRAIN_LOADER_WORKERS": str(a.workers)}


def child(a) -> None:
    """One side, in this process: every training step's record timestamped; results to --out."""
    import logging, resource

    import torch

    steps, work = [], Path(a.work)
    cuda = a.device.startswith("cuda")

    class Clock(logging.Handler):
        def emit(self, record):
            m = record.msg
            if record.name == "speculators.metrics" and isinstance(m, dict) and "train" in m:
                p = m["profile"]
                steps.append({"t": time.perf_counter(), "tokens": round(p["tokens_per_s"] * p["step_ms"] / 1000),
                              "step_ms": p["step_ms"], "epoch": m["epoch"],
                              "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None})

    stderr = logging.StreamHandler()
    stderr.setLevel(logging.WARNING)
    logging.getLogger().handlers[:] = [Clock(), stderr]  # both sides alike; speculators' basicConfig is then a no-op
    t0 = time.perf_counter()
    if a.child == "eyrie":
        import redis

        from eyrie.config import load_settings
        from eyrie.store import FileStore
        from eyrie_trainer.runner import TrainRunner

        settings = load_settings()
        result = TrainRunner(settings, redis.Redis.from_url(settings.redis_url), FileStore(work / "store"), RUN).run()
    else:
        from eyrie_trainer import engine

        result = engine.train(json.loads(a.argv), a.device, engine.Hooks())
    Path(a.out).write_text(json.dumps({"steps": steps, "t0": t0, "t_end": time.perf_counter(), "result": result}))


def run_literal_cli(argv: list[str], env: dict) -> dict:
    """GPU reference: `speculators train ARGV`; its printed step records timestamped on arrival."""
    num = r"([-+0-9.e]+)"
    steps, t0 = [], time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "speculators"), "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "100000"})
    for line in proc.stdout:
        ms, tps = re.search(r"profile/step_ms=" + num, line), re.search(r"profile/tokens_per_s=" + num, line)
        if ms and tps and "train/" in line:
            mem = [float(x) for x in re.findall(r"profile/memory_mb/\w+=" + num, line)]
            epoch = re.search(r"\bepoch=(\d+)", line)
            steps.append({"t": time.perf_counter(), "tokens": round(float(tps[1]) * float(ms[1]) / 1000),
                          "step_ms": float(ms[1]), "epoch": int(epoch[1]) if epoch else 0, "rss_mb": None,
                          "gpu_mb": max(mem) if mem else None})
    if proc.wait():
        raise RuntimeError(f"speculators train exited with {proc.returncode}")
    return {"steps": steps, "t0": t0, "t_end": time.perf_counter(), "result": {}}


def side(name: str, a, work: Path, env: dict, argv: list[str], rnd: int) -> dict:
    from eyrie.manifest import Layout
    from eyrie.store import FileStore

    out, t0 = work / f"{name}-{rnd}.json", time.perf_counter()
    if name == "eyrie":  # a fresh train stage each round: nothing to resume from, nothing already exported
        import redis

        store, layout = FileStore(work / "store"), Layout(RUN)
        for key in store.list(layout.train + "/"):
            store.delete(key)
        store.put_bytes(layout.manifest, (work / "manifest.json").read_bytes())
        redis.Redis.from_url(env["EYRIE_REDIS_URL"]).flushdb()
    save = work / f"ref-ck-{rnd}"
    argv = [x if x not in ("SAVE", "LOGS") else str(save if x == "SAVE" else save / "logs") for x in argv]
    cpu0, log = psutil.cpu_times(), work / f"{name}-{rnd}.log"
    busy = lambda c: c.user + c.nice + c.system + c.irq + c.softirq + getattr(c, "steal", 0)
    if name == "ref" and a.device.startswith("cuda"):
        res, own = run_literal_cli(argv, env), None
    else:
        cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--out", str(out),
               "--device", a.device, "--argv", json.dumps(argv)]
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise RuntimeError(f"{name} failed ({status}):\n" + log.read_text()[-4000:])
        res, own = json.loads(out.read_text()), usage.ru_utime + usage.ru_stime
    wall = time.perf_counter() - t0
    other = None if own is None else max(0.0, (busy(psutil.cpu_times()) - busy(cpu0) - own) / wall)
    shutil.rmtree(save, ignore_errors=True)
    s = res["steps"]
    if len(s) < 3:
        raise RuntimeError(f"{name}: only {len(s)} training steps recorded")
    window, tokens = s[-1]["t"] - s[0]["t"], sum(x["tokens"] for x in s[1:])
    gaps = [s[i]["t"] - s[i - 1]["t"] for i in range(1, len(s)) if s[i]["epoch"] != s[i - 1]["epoch"]]
    inner = [s[i]["t"] - s[i - 1]["t"] for i in range(1, len(s)) if s[i]["epoch"] == s[i - 1]["epoch"]]
    return {"side": name, "round": rnd, "steps": len(s), "tokens": tokens, "window_s": window,
            "tok_s": tokens / window, "step_s": statistics.median(inner), "boundary_s": sum(gaps),
            "wall_s": wall, "other_cores": other,
            "startup_s": s[0]["t"] - res["t0"], "rss_mb": s[-1]["rss_mb"],
            "gpu_mb": max((x["gpu_mb"] or 0) for x in s) or None, "result": res["result"]}


def machine() -> str:
    import platform
    from importlib.metadata import version

    import torch

    model = re.search(r"Model name:\s*(.+)", subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{os.cpu_count()} CPUs ({model[1].strip() if model else '?'}), "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM{gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {version('transformers')}, speculators {version('speculators')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in [("--device", "cpu"), ("--hidden", 512), ("--vocab", 8192), ("--layers", 8), ("--samples", 80),
                          ("--seq-len", 512), ("--total-seq-len", 2048), ("--draft-vocab", 2048), ("--epochs", 2),
                          ("--max-steps", None), ("--heldout", 4), ("--workers", 2), ("--rounds", 3), ("--nice", 0),
                          ("--out-md", str(ROOT / "bench" / "RESULTS.md")), ("--child", None), ("--work", None),
                          ("--out", None), ("--argv", None)]:
        p.add_argument(flag, default=default, type=type(default) if default is not None else
                       (int if flag == "--max-steps" else str))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    os.environ.update(OFFLINE)
    if a.child:
        return child(a)
    os.nice(a.nice)  # inherited by both sides alike
    started, load0 = time.perf_counter(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="eyrie-train-bench-"))
    with socket.socket() as sock:
        redis_port = sock.bind(("127.0.0.1", 0)) or sock.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)
    try:
        env = settings_env(work, a, f"redis://127.0.0.1:{redis_port}/0")
        os.environ.update({k: v for k, v in env.items() if k.startswith("EYRIE_")})
        t = time.perf_counter()
        build(work, a)
        import redis

        from eyrie.config import load_settings
        from eyrie.store import FileStore
        from eyrie_trainer import engine
        from eyrie_trainer.runner import TrainRunner

        runner = TrainRunner(load_settings(), redis.Redis(port=redis_port), FileStore(work / "store"), RUN)
        train_dir, _ = runner._prepare_data()
        argv = runner._argv(train_dir) + engine.path_flags(engine.SAFE_PATH)
        argv[argv.index("--save-path") + 1], argv[argv.index("--log-dir") + 1] = "SAVE", "LOGS"
        print(f"data built and materialized in {time.perf_counter() - t:.0f} s ({work})", flush=True)
        res = {"eyrie": [], "ref": []}
        for rnd in range(a.rounds):
            for name in (("eyrie", "ref") if rnd % 2 == 0 else ("ref", "eyrie")):
                m = side(name, a, work, env, argv, rnd)
                res[name].append(m)
                print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in m.items()), flush=True)
        lines = report(a, res, argv, machine(), load0, os.getloadavg(), time.perf_counter() - started)
        print("\n".join(lines))
        if not a.no_write:
            write_section(Path(a.out_md), lines)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


def report(a, res, argv, mach, load0, load1, total) -> list[str]:
    med = lambda name, k: statistics.median(m[k] for m in res[name])
    ratios = [e["tok_s"] / r["tok_s"] for e, r in zip(res["eyrie"], res["ref"])]
    ratio, cpu = med("eyrie", "tok_s") / med("ref", "tok_s"), a.device == "cpu"
    argv_text = " ".join(x or "''" for x in argv)
    memk, mem = ("rss_mb", "peak RSS of the training process, MB") if cpu else ("gpu_mb", "peak GPU memory, MiB")
    ref = ("speculators.train.cli.main(TrainConfig.resolve(argv)) in-process under eyrie's minimal device shim "
           "(engine.train(argv, 'cpu', Hooks()), no-op hooks). The unmodified `speculators train` CLI cannot run on a "
           "CPU (it calls CUDA), so this is the closest reference" if cpu else
           "the literal `speculators train ARGV` CLI in a subprocess")
    out = ["# Train throughput: eyrie's train task vs speculators' `train`", "", f"- Machine: {mach}.",
           f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. Load average before: {load0[0]:.2f} "
           f"(1 min), after: {load1[0]:.2f}; cores busy with other work during each side's run: see the table.",
           f"- Command: `python bench/train_throughput.py{''.join(' ' + x for x in sys.argv[1:])}`; {total:.0f} s in all.",
           f"- Data: random Llama-shaped target (hidden {a.hidden}, vocab {a.vocab}, {a.layers} layers; only "
           f"embed_tokens, lm_head and model.norm written), {a.samples} samples x {a.seq_len} random tokens (loss mask "
           f"over the last 3/4), random bf16 hidden states [{a.seq_len}, 4, {a.hidden}], an eyrie run in a FileStore; "
           f"{a.heldout} held out by eyrie's plan, the rest materialized once by TrainRunner._prepare_data; speculators "
           "trains on 90% of that directory and validates on 10%.",
           f"- Settings, the same argv on both sides (TrainRunner._argv + sdpa/eager; SAVE/LOGS: a fresh directory per "
           f"run): `{argv_text}`.",
           "- eyrie: `TrainRunner(settings, redis, store, run).run()` in a subprocess (restore from the store, Redis "
           "progress per step, heartbeat, checkpoint upload after each epoch; evaluation and export come after "
           f"training and are not timed). Reference: {ref}.",
           "- Timing, identical on both sides: speculators logs each step's record right after the optimizer step; "
           "tokens/s = tokens of steps 2..N / time from step 1's record to step N's (start-up, data loader spawn and "
           "step 1 out; epoch boundaries with checkpoint save, validation and eyrie's upload in). "
           f"{a.rounds} rounds, interleaved, the order alternating each round.", "",
           f"| round | side | tok/s | steps timed | window s | median step ms | epoch boundaries s | start-up s | wall s "
           f"| {mem} | other load, cores |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for rnd in [*range(a.rounds), "median"]:
        for name in ("eyrie", "ref"):
            m = res[name][rnd] if rnd != "median" else {k: med(name, k) for k in res[name][0]
                                                          if isinstance(res[name][0][k], (int, float))}
            out.append(f"| {rnd} | {name} | {'**' * (rnd == 'median')}{m['tok_s']:.0f}{'**' * (rnd == 'median')} | "
                       f"{m['steps'] - 1:.0f} | {m['window_s']:.1f} | {m['step_s'] * 1000:.0f} | {m['boundary_s']:.2f} | "
                       f"{m['startup_s']:.1f} | {m['wall_s']:.1f} | {f(m.get(memk), '.0f')} | "
                       f"{f(m.get('other_cores'), '.2f')} |")
    out += ["", f"- {'MET' if ratio >= 0.95 else '**NOT MET**'}: eyrie >= 0.95x the reference: **{ratio:.3f}x** "
            f"(ratio of the medians; per round {', '.join(f'{x:.3f}' for x in ratios)})."]
    return out


def write_section(path: Path, lines: list[str]) -> None:
    """Replace an earlier `# Train throughput` section (up to the next top-level heading) or append it."""
    text = path.read_text() if path.exists() else ""
    marker = "\n# Train throughput"
    if marker in text:
        start = text.index(marker)
        nxt = text.find("\n# ", start + 1)
        text = text[:start] + (text[nxt:] if nxt != -1 else "")
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
