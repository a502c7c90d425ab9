"""Train-stage throughput: eyrie's train task vs speculators' own `train` entry, same data, same argv.

Run on demand (not a test):  .venv/bin/python bench/train_throughput.py --nice -10     (CPU, small random target)
  GPU, 8B-shaped target:     .venv/bin/python bench/train_throughput.py --device cuda --hidden 4096 --vocab 128256 \\
                             --layers 32 --samples 160 --seq-len 2048 --total-seq-len 8192 --draft-vocab 32000 --workers 4

Built in a temporary directory: a random Llama-shaped target (config, the tiny target's tokenizer, and only what
speculators' drafter reads from a verifier: embed_tokens, lm_head, model.norm); a FileStore holding a real eyrie run
(run manifest, train plan from eyrie_trainer.plan, extract shard manifests with the entries ExtractRunner._put and
_finish write, sample files from eyrie_extractor.shard.sample_tensors: random token ids and bf16 hidden states
[L, n_aux+1, H]); a redis-server. TrainRunner._prepare_data materializes it once; both sides train on that
directory with the argv TrainRunner._argv builds (+ sdpa, eager loss), each in a fresh process, interleaved:
  eyrie  execute(TrainRunner, {run}, Context(settings, redis, store)): the real train task (restore, Redis
         progress per step, heartbeat, checkpoint upload after each epoch; evaluation and export follow, untimed)
  ref    CPU: speculators.train.cli.main(TrainConfig.resolve(argv)) under eyrie's device shim with no-op hooks
         (engine.train(argv, "cpu", Hooks())): the CLI as shipped calls CUDA. GPU: `speculators train ARGV`.
Alike on both sides: speculators logs a dict per step on "speculators.metrics" (log-freq 1) right after the
optimizer step; tokens/s = tokens of steps 2..N (its `profile` counts) / time from step 1's record to step N's
(start-up, loader spawn and step 1 out; epoch boundaries in). In-process sides timestamp the records in a root
logging handler, the literal CLI's printed ones are timestamped here on arrival. Memory: CPU ru_maxrss of the
training process (loader workers not counted); GPU torch.cuda.max_memory_allocated (literal CLI: the largest
memory_allocated of its step profiles).
"""

from __future__ import annotations

import argparse, datetime as dt, json, os, re, shutil, socket, statistics, subprocess, sys, tempfile, time
from pathlib import Path

import psutil
import redis

from eyrie.data.manifest import Layout
from eyrie.data.store import FileStore
from tests.support.processes import start_redis, stop

from results import write_section

ROOT = Path(__file__).resolve().parent.parent
RUN = "bench-train"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"}


def build(work: Path, a) -> None:
    """The target directory; the store with the extracted run and its train plan."""
    import torch
    from safetensors.torch import save, save_file
    from transformers import LlamaConfig
    from eyrie.core.layers import default_aux_layers
    from eyrie.data.manifest import (Counts, DatasetRef, ExtractParams, GenerateParams, RunManifest, SamplingParams,
                                     ShardManifest, ShardPlan, TargetRef, code_version, now_iso)
    from eyrie_extractor.shard import sample_tensors
    from eyrie.core.stage_settings import GenerateSettings, TrainSettings
    from eyrie.stages.start_checks import extract_done
    from eyrie_trainer.plan import plan

    target, g = work / "target", torch.Generator().manual_seed(0)
    heads = a.hidden // 128 if a.hidden >= 2048 else a.hidden // 64
    LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 7 // 2, num_hidden_layers=a.layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=a.vocab,
                max_position_embeddings=max(8192, a.total_seq_len), rms_norm_eps=1e-5,
                tie_word_embeddings=False).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # speculators resolves the mask token with it
        shutil.copy(ROOT / "assets" / "tiny-target" / name, target / name)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.bfloat16)
    save_file({"model.embed_tokens.weight": rand(a.vocab, a.hidden) * 0.02, "lm_head.weight": rand(a.vocab, a.hidden)
               * 0.02, "model.norm.weight": torch.ones(a.hidden, dtype=torch.bfloat16)}, str(target / "model.safetensors"))
    store, layout, aux, size = FileStore(work / "store"), Layout(RUN), default_aux_layers(a.layers), 1000
    shards = [{r: f"{r:024x}" for r in range(start, min(a.samples, start + size))} for start in range(0, a.samples, size)]
    plans = [ShardPlan(index=i, row_start=min(ids), row_end=max(ids) + 1, input_key=layout.generate_input(i),
                       input_sha256="0" * 64) for i, ids in enumerate(shards)]  # generate's input: not read by train
    manifest = RunManifest(
        run=RUN, created_at=now_iso(), code_version=code_version(), generate_shards=plans,
        target=TargetRef(model=str(target), revision="random", chat_template_sha256=None, server="transformers"),
        dataset=DatasetRef(source="synthetic", kind="jsonl", revision="0" * 64, row_end=a.samples),
        generate=GenerateParams(sampling=SamplingParams(max_tokens=a.seq_len), shard_size=size, **{
            name: getattr(GenerateSettings(), name) for name in ("concurrency", "request_timeout_s", "max_retries")}),
        extract=ExtractParams(backend="hf", aux_layers=aux, dtype="bf16", max_length=None, num_layers=a.layers,
                              hidden_size=a.hidden, samples=a.samples, tokens=a.samples * a.seq_len, truncated=0,
                              projected_bytes=a.samples * a.seq_len * (len(aux) + 1) * a.hidden * 2, budget_bytes=None))
    store.put_json(layout.manifest, manifest.model_dump())
    for index, ids in enumerate(shards):
        started, entries = now_iso(), []
        for row, sid in ids.items():
            tokens = torch.randint(0, a.vocab, (a.seq_len,), generator=g).tolist()
            data = save(sample_tensors(rand(a.seq_len, len(aux) + 1, a.hidden), tokens, "bf16"))
            info = store.put_bytes(layout.extract_sample(index, sid), data)
            entries.append({"sample_id": sid, "row": row, "status": "done", "key": info.key, "sha256": info.sha256,
                            "bytes": info.size, "seq_len": a.seq_len, "prompt_len": a.seq_len // 4,
                            "source": "server", "mismatch": False, "truncated": False})
        counts = Counts(total=len(entries), done=len(entries), tokens=a.seq_len * len(entries),
                        bytes=sum(e["bytes"] for e in entries))
        store.put_json(layout.extract_shard_manifest(index), ShardManifest(
            run=RUN, stage="extract", shard=index, bytes=counts.bytes, counts=counts, skip_reasons={},
            failure_errors={}, started_at=started, finished_at=now_iso(), worker=socket.gethostname(),
            samples=entries).model_dump())
    extract_done(store, manifest)
    request = TrainSettings(epochs=a.epochs, max_steps=a.max_steps or None, heldout=a.heldout, draft_vocab=a.draft_vocab,
                            seq_len=a.total_seq_len)
    manifest.train = plan(store, manifest, request, work / "cache")
    store.put_json(layout.manifest, manifest.model_dump())
    (work / "manifest.json").write_text(json.dumps(manifest.model_dump()))


def child(a) -> None:
    """One side, in this process: every training step's record timestamped; results to --out."""
    import logging, resource
    import torch

    steps, cuda = [], a.device.startswith("cuda")

    class Clock(logging.Handler):
        def emit(self, record):
            m = record.msg
            if record.name == "speculators.metrics" and isinstance(m, dict) and "train" in m:
                p = m["profile"]
                steps.append({"t": time.perf_counter(), "tokens": round(p["tokens_per_s"] * p["step_ms"] / 1000),
                              "epoch": m["epoch"], "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None})

    stderr = logging.StreamHandler()
    stderr.setLevel(logging.WARNING)
    logging.getLogger().handlers[:] = [Clock(), stderr]  # alike on both sides: speculators' basicConfig then adds none
    t0 = time.perf_counter()
    if a.child == "eyrie":
        from eyrie.core.config import load_settings
        from eyrie.tasks.executor import Context, execute
        from eyrie_trainer.runner import TrainRunner
        settings = load_settings()
        result = execute(TrainRunner, {"run": RUN}, Context(settings, redis.Redis.from_url(settings.redis_url),
                                                            FileStore(Path(a.work) / "store")))
    else:
        from eyrie_trainer import engine
        result = engine.train(json.loads(a.argv), a.device, engine.Hooks())
    Path(a.out).write_text(json.dumps({"steps": steps, "t0": t0, "result": result}))


def literal_cli(argv: list[str], env: dict, log: Path) -> dict:
    """GPU reference: `speculators train ARGV`; its printed step records timestamped on arrival."""
    num, steps, t0 = r"([-+0-9.e]+)", [], time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "speculators"), "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "100000"})
    with log.open("w") as f:
        for line in proc.stdout:
            f.write(line)
            ms, tps = re.search(r"profile/step_ms=" + num, line), re.search(r"profile/tokens_per_s=" + num, line)
            if ms and tps and "train/" in line:
                mem = [float(x) for x in re.findall(r"profile/memory_mb/\w+=" + num, line)]
                steps.append({"t": time.perf_counter(), "tokens": round(float(tps[1]) * float(ms[1]) / 1000),
                              "epoch": int(re.search(r"\bepoch=(\d+)", line)[1]), "rss_mb": None,
                              "gpu_mb": max(mem, default=None)})
    if proc.wait():
        raise RuntimeError(f"speculators train exited with {proc.returncode}:\n" + log.read_text()[-4000:])
    return {"steps": steps, "t0": t0, "result": None}


def side(name: str, a, work: Path, env: dict, argv: list[str], rnd: int, exact: list[int] | None) -> dict:
    out, log, save, t0 = work / f"{name}-{rnd}.json", work / f"{name}-{rnd}.log", work / f"ref-{rnd}", time.perf_counter()
    if name == "eyrie":  # a fresh train stage each round: nothing to resume from, nothing exported yet
        store, layout = FileStore(work / "store"), Layout(RUN)
        for key in store.list(layout.train + "/"):
            store.delete(key)
        store.put_bytes(layout.manifest, (work / "manifest.json").read_bytes())
        redis.Redis.from_url(env["EYRIE_REDIS_URL"]).flushdb()
    argv = [{"SAVE": str(save), "LOGS": str(save / "logs")}.get(x, x) for x in argv]
    busy = lambda c: c.user + c.nice + c.system + c.irq + c.softirq + c.steal
    cpu0 = busy(psutil.cpu_times())
    if name == "ref" and a.device != "cpu":
        res, own = literal_cli(argv, env, log), None
        if exact and len(exact) == len(res["steps"]):  # same sampler, same batches: eyrie's exact counts
            for step, tokens in zip(res["steps"], exact):  # (the printed ones have 3 significant digits)
                step["tokens"] = tokens
    else:
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--work", str(work), "--out", str(out),
                                     "--device", a.device, "--argv", json.dumps(argv)], env=env, stdout=f, stderr=f)
            _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise RuntimeError(f"{name} failed ({status}):\n" + log.read_text()[-4000:])
        res, own = json.loads(out.read_text()), usage.ru_utime + usage.ru_stime
    wall = time.perf_counter() - t0
    shutil.rmtree(save, ignore_errors=True)
    s = res["steps"]
    if len(s) < 3:
        raise RuntimeError(f"{name}: {len(s)} training steps recorded; see {log}")
    window, tokens = s[-1]["t"] - s[0]["t"], sum(x["tokens"] for x in s[1:])
    gaps = [(s[i]["t"] - s[i - 1]["t"], s[i]["epoch"] != s[i - 1]["epoch"]) for i in range(1, len(s))]
    boundary = sum(gap for gap, crossed in gaps if crossed)
    return {"tok_s": tokens / window, "steps_tok_s": tokens / (window - boundary), "steps": len(s) - 1,
            "window_s": window, "step_ms": statistics.median(gap for gap, crossed in gaps if not crossed) * 1000,
            "boundary_s": boundary, "startup_s": s[0]["t"] - res["t0"], "wall_s": wall, "rss_mb": s[-1]["rss_mb"],
            "gpu_mb": max((x["gpu_mb"] or 0) for x in s) or None, "tokens": [x["tokens"] for x in s],
            "other_cores": None if own is None else max(0.0, (busy(psutil.cpu_times()) - cpu0 - own) / wall)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in [("--device", "cpu"), ("--hidden", 512), ("--vocab", 8192), ("--layers", 8), ("--samples", 80),
                          ("--seq-len", 512), ("--total-seq-len", 2048), ("--draft-vocab", 2048), ("--epochs", 2),
                          ("--max-steps", 0), ("--heldout", 4), ("--workers", 2), ("--rounds", 3), ("--nice", 0),
                          ("--out-md", str(ROOT / "bench" / "RESULTS.md")), ("--child", ""), ("--work", ""),
                          ("--out", ""), ("--argv", ""), ("--fast-path", "off")]:
        p.add_argument(flag, default=default, type=type(default))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    os.environ.update(OFFLINE)
    if a.child:
        return child(a)
    os.nice(a.nice)  # inherited by both sides alike
    started, load0 = time.perf_counter(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="eyrie-train-bench-"))
    server, redis_url = start_redis(work)
    try:
        env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url, "EYRIE_DEVICE": a.device,
               "EYRIE_STORE_URL": f"file://{work / 'store'}", "EYRIE_CACHE_DIR": str(work / "cache"),
               "EYRIE_TRAIN_FAST_PATH": a.fast_path, "EYRIE_TRAIN_LOADER_WORKERS": str(a.workers)}
        os.environ.update(env)
        build(work, a)
        from eyrie.core.config import load_settings
        from eyrie_trainer import engine
        from eyrie.tasks.executor import Context, RunTask
        from eyrie_trainer.runner import TrainRunner
        runner = TrainRunner(Context(load_settings(), redis.Redis.from_url(redis_url), FileStore(work / "store")),
                             RunTask(run=RUN))
        runner.load_plan()
        train_dir, _ = runner._prepare_data()
        argv = runner._argv(train_dir, a.device) + engine.path_flags(engine.SAFE_PATH)
        argv[argv.index("--save-path") + 1], argv[argv.index("--log-dir") + 1] = "SAVE", "LOGS"
        print(f"run built and materialized in {time.perf_counter() - started:.0f} s ({work})", flush=True)
        res = {"eyrie": [], "ref": []}
        for rnd in range(a.rounds):
            for name in (("eyrie", "ref") if rnd % 2 == 0 else ("ref", "eyrie")):
                exact = res["eyrie"][0]["tokens"] if res["eyrie"] else None
                res[name].append(m := side(name, a, work, env, argv, rnd, exact))
                print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()
                                                          if isinstance(v, float)), flush=True)
        lines = report(a, res, argv, load0, os.getloadavg(), time.perf_counter() - started)
        print("\n".join(lines))
        if not a.no_write:
            write_section(Path(a.out_md), lines)
    finally:
        stop(server)
        shutil.rmtree(work, ignore_errors=True)


def report(a, res, argv, load0, load1, total) -> list[str]:
    import platform
    from importlib.metadata import version
    import torch

    cpu_model = re.search(r"Model name:\s*(.+)", subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    machine = (f"{os.cpu_count()} CPUs ({cpu_model[1].strip() if cpu_model else '?'}), "
               f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM{gpu}; Python {platform.python_version()}, torch "
               f"{torch.__version__}, transformers {version('transformers')}, speculators {version('speculators')}")
    med = lambda name, k: statistics.median(m[k] for m in res[name]) if res[name][0][k] is not None else None
    ratio, cpu = med("eyrie", "tok_s") / med("ref", "tok_s"), a.device == "cpu"
    per_round = [e["tok_s"] / r["tok_s"] for e, r in zip(res["eyrie"], res["ref"])]
    argv_text = " ".join(x or "''" for x in argv)
    memk, mem = ("rss_mb", "peak RSS of the training process, MB") if cpu else ("gpu_mb", "peak GPU memory, MiB")
    ref = ("speculators.train.cli.main(TrainConfig.resolve(argv)) in-process under eyrie's minimal device shim, no-op "
           "hooks (engine.train(argv, 'cpu', Hooks())): the unmodified `speculators train` CLI cannot run on a CPU (it "
           "calls CUDA: `RuntimeError: Cannot access accelerator device when none is available.` at "
           "`self.model.to(self.local_rank)` in Trainer.setup_model), so this is the closest reference" if cpu else
           "the literal `speculators train ARGV` CLI in a subprocess")
    out = ["# Train throughput: eyrie's train task vs speculators' `train`", "", f"- Machine: {machine}.",
           f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; load average before {load0[0]:.2f}, after "
           f"{load1[0]:.2f}. Command: `python bench/train_throughput.py{''.join(' ' + x for x in sys.argv[1:])}`; "
           f"{total:.0f} s. Method: the script's docstring.",
           f"- Data: random Llama-shaped target (hidden {a.hidden}, vocab {a.vocab}, {a.layers} layers), {a.samples} "
           f"samples x {a.seq_len} random tokens with random bf16 hidden states [{a.seq_len}, 4, {a.hidden}] as an "
           f"eyrie run in a FileStore; {a.heldout} held out by eyrie's plan; speculators trains on 90% of the rest.",
           f"- The same argv on both sides (SAVE/LOGS: a fresh directory per run): `{argv_text}`.",
           f"- eyrie: `execute(TrainRunner, {{'run': run}}, Context(settings, redis, store))` in a subprocess. Reference: {ref}.",
           "- tokens/s = tokens of steps 2..N / time from step 1's metrics record to step N's (epoch boundaries: "
           "checkpoint save, validation, eyrie's upload, in; 'steps only': out). "
           f"{a.rounds} rounds, interleaved, the order alternating by round.", "",
           f"| round | side | tok/s | steps only, tok/s | steps timed | window s | median step ms | epoch boundaries s "
           f"| start-up s | wall s | {mem} | other load, cores |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for rnd in [*range(a.rounds), "median"]:
        for name in ("eyrie", "ref"):
            m = res[name][rnd] if rnd != "median" else {k: med(name, k) for k in res[name][0] if k != "tokens"}
            b = "**" if rnd == "median" else ""
            out.append(f"| {rnd} | {name} | {b}{m['tok_s']:.0f}{b} | {m['steps_tok_s']:.0f} | {m['steps']:.0f} | "
                       f"{m['window_s']:.1f} | {m['step_ms']:.0f} | {m['boundary_s']:.1f} | {m['startup_s']:.1f} | "
                       f"{m['wall_s']:.1f} | {fmt(m[memk], '.0f')} | {fmt(m['other_cores'], '.2f')} |")
    out += ["", f"- {'MET' if ratio >= 0.95 else '**NOT MET**'}: eyrie >= 0.95x the reference: **{ratio:.3f}x** "
            f"(ratio of the medians; per round {', '.join(f'{x:.3f}' for x in per_round)}); steps only "
            f"{med('eyrie', 'steps_tok_s') / med('ref', 'steps_tok_s'):.3f}x."]
    return out


if __name__ == "__main__":
    main()
