"""Learning curve: how a drafter's quality and cost grow with training data, measured by vLLM.

  .venv/bin/python bench/learning_curve.py --run RUN --sizes 1000,2000,4000,8000     (--help: every option)
On a run the pipeline has generated and extracted (EYRIE_* as for every eyrie command; no worker on the GPU). Held
out: the pipeline's own samples; slice n: the first n of the others sorted by sample id (a hash), so slices nest.
Each slice: trained by eyrie's engine with the train stage's options (timed), its last epoch's checkpoint judged by
eyrie (evaluate.simulate, held out) and written as a drafter vLLM loads. The anchor: speculators' own entry point and
defaults on the largest slice, given only what it requires and what the machine needs. vLLM, as `eyrie verify`: the
target alone once, then each drafter (eagle3, K), on the held-out prompts and the benchmarks. Generation and
extraction times: the run's shard manifests. Writes --out (JSON), an SVG plot beside it, a section of --results.
"""

import argparse, datetime as dt, gc, json, math, os, platform, re, shlex, shutil, subprocess, sys, time
from pathlib import Path
from xml.sax.saxutils import escape

import torch

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.pipeline import stored_config
from eyrie.work.gpu import pick_device
from eyrie_trainer import engine
from eyrie_trainer.data import done_samples, heldout_ids, materialize
from eyrie_trainer.evaluate import simulate
from eyrie_trainer.export import _served_config, _transfer, load_drafter
from eyrie_trainer.verify import (HELDOUT, Served, answer_limits, benchmark_prompts, benchmark_result, heldout_prompts,
                                  max_model_len, serve_flags)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERIAL = 4  # prompts answered one at a time, for tokens/s at 1 in flight
NOTABLE = ("epochs", "lr", "optimizer", "scheduler_type", "total_seq_len", "draft_vocab_size", "num_layers",
           "ttt_steps", "loss_fn", "train_data_ratio", "seed", "draft_attn_impl", "loss_implementation", "num_workers")
GIVEN = {"verifier_name_or_path", "data_path", "save_path", "target_layer_ids", "log_dir", "num_workers", "epochs"}
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def slices(samples: list[dict], heldout: set[str], sizes: list[int]) -> tuple[list[str], dict[int, list[str]]]:
    """The training pool (every sample id not held out, sorted) and slice n of it: its first n."""
    pool = sorted(s["sample_id"] for s in samples if s["sample_id"] not in heldout)
    if not sizes or not 1 <= min(sizes) <= max(sizes) <= len(pool):
        raise SystemExit(f"sizes {sizes}: each must be 1 to {len(pool)}, the training pool (the run's extracted "
                         f"samples less the {len(heldout)} held out).")
    return pool, {n: pool[:n] for n in sorted(set(sizes))}


def stage_time(shards: list[dict]) -> dict:
    """A stage's wall time from its shard manifests: first start to last finish (1 s resolution)."""
    start = min(dt.datetime.fromisoformat(s["started_at"]) for s in shards)
    wall = (max(dt.datetime.fromisoformat(s["finished_at"]) for s in shards) - start).total_seconds()
    done = sum(s["counts"]["done"] for s in shards)
    return {"wall_s": wall, "prompts": done, "shards": len(shards), "s_per_1k": wall / done * 1000 if done else None}


def _f(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def _row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def section(r: dict, svg: str | None = None) -> list[str]:
    """The RESULTS.md section from the JSON result: the curve, the stage times, the anchor."""
    sets, m, answered = list(r["sets"]), r["machine"], sum(r["sets"].values())
    gpu, per_1k = f", {m['gpu']}" if m["gpu"] else "", lambda s, n: _f(s / 60 / n * 1000, ".1f")
    out = [f"# Learning curve: {r['target_name']} (bench/learning_curve.py)", "",
           f"- Machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM{gpu}; {r['date']}; commit "
           f"`{r['commit']}`.", f"- Command: `{r['command']}`",
           f"- Run `{r['run']}` ({r['target']}): {r['heldout_samples']} held-out samples, a pool of {r['pool']}; "
           f"{r['epochs']} epochs on {r['device']}; vLLM at K={r['k']}, greedy, at most {r['max_tokens']} tokens; "
           + ", ".join(f"{n} {c} prompts" for n, c in r["sets"].items()) + ".", "",
           _row("training prompts", "eyrie τ held-out", *(f"vLLM acceptance {s}" for s in sets),
                *(f"speedup @1 {s}" for s in sets), "train min / 1k prompts"), "|" + "---|" * (3 + 2 * len(sets))]
    for p in r["points"]:
        out.append(_row(p["prompts"], _f(p["eyrie_tau"]), *(_f(p["sets"][s]["vllm_acceptance_length"]) for s in sets),
                        *(_f(p["sets"][s]["speedup"]["1"]) for s in sets), per_1k(p["train_s"], p["prompts"])))
    out += ["", f"![vLLM acceptance length per set against training prompts]({svg})"] if svg else []
    out += ["", _row("stage", "measured on", "wall min", "min / 1k prompts"), "|---|---|---|---|"]
    for stage, t in r["stage_times"].items():
        out.append(_row(stage, f"n/a: {t['n/a']}", "-", "-") if "n/a" in t else _row(
            stage, f"{t['prompts']} prompts, {t['shards']} shards (shard manifests: first start to last finish)",
            _f(t["wall_s"] / 60, ".1f"), per_1k(t["wall_s"], t["prompts"]) if t["prompts"] else "-"))
    for p in r["points"] + ([r["anchor"]] if r.get("anchor") else []):
        who = "speculators' defaults" if p["label"] == "anchor" else "eyrie"
        out.append(_row(f"train ({who})", f"{p['prompts']} prompts, {p['epochs']} epochs, timed here",
                        _f(p["train_s"] / 60, ".1f"), per_1k(p["train_s"], p["prompts"])))
        out.append(_row(f"verify ({who}, {p['prompts']})", f"{answered} prompts, server start in, timed here",
                        _f(p["verify_s"] / 60, ".1f"), per_1k(p["verify_s"], answered)))
    return out + (anchor_lines(r) if r.get("anchor") else [])


def anchor_lines(r: dict) -> list[str]:
    a, eyrie = r["anchor"], next(p for p in r["points"] if p["prompts"] == r["anchor"]["prompts"])
    given = ", ".join(f"{k} {v}" for k, v in a["given"].items() if k in NOTABLE or k == "target_layer_ids")
    taken = ", ".join(f"{k} {v}" for k, v in a["defaults"].items())
    out = ["", f"Beside speculators' own training on the same {a['prompts']} samples (speculators.train.cli.main "
           f"in eyrie's device shim), given {given}; defaults taken: {taken}. {a['note']}", "",
           _row("set", "eyrie", "speculators", "eyrie / speculators"), "|---|---|---|---|"]
    pairs = [("eyrie τ held-out (simulated)", eyrie["eyrie_tau"], a["eyrie_tau"])] + [
        (f"vLLM acceptance {s}", eyrie["sets"][s]["vllm_acceptance_length"], a["sets"][s]["vllm_acceptance_length"])
        for s in r["sets"]]
    return out + [_row(name, _f(x), _f(y), _f(x / y, ".3f") if x is not None and y else "-") for name, x, y in pairs]


def svg_plot(curves: dict[str, list[tuple[int, float]]], title: str) -> str:
    """Acceptance length per set against training prompts (log scale): one polyline per set."""
    w, h, left, right, top, bottom = 640, 400, 60, 150, 40, 50
    xs = sorted({x for pts in curves.values() for x, _ in pts}) or [1]
    ys = [y for pts in curves.values() for _, y in pts if y is not None] or [1.0]
    lo_x, hi_x, lo_y, hi_y = math.log(xs[0]), math.log(xs[-1]), min(1.0, min(ys)), max(ys) * 1.05
    px = lambda x: left + (w - left - right) * ((math.log(x) - lo_x) / (hi_x - lo_x) if hi_x > lo_x else 0.5)
    py = lambda y: h - bottom - (h - top - bottom) * (y - lo_y) / ((hi_y - lo_y) or 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" style="font: 12px sans-serif">',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<path d="M{left},{top} V{h - bottom} H{w - right}" fill="none" stroke="black"/>',
             f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">training prompts</text>',
             f'<text x="15" y="{h / 2}" text-anchor="middle" transform="rotate(-90 15 {h / 2})">'
             'acceptance length</text>']
    parts += [f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>' for x in xs]
    parts += [f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>'
              for y in (lo_y + (hi_y - lo_y) * i / 4 for i in range(5))]
    for i, (name, pts) in enumerate(curves.items()):
        color, pts = COLORS[i % len(COLORS)], [(x, y) for x, y in pts if y is not None]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts) + '"/>')
        parts.append(f'<text x="{w - right + 10}" y="{top + 18 * i + 10}" fill="{color}">{escape(name)}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def machine() -> dict:
    """The machine, the date and the commit (+uncommitted when the tree has changes)."""
    cpu, mem = (re.search(pattern, Path(f).read_text()) for f, pattern in (
        ("/proc/cpuinfo", r"model name\s*:\s*(.+)"), ("/proc/meminfo", r"MemTotal:\s+(\d+)")))
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"machine": {"cpu": platform.processor() or (cpu[1] if cpu else "?"), "cpus": os.cpu_count(),
                        "memory_gib": round(int(mem[1]) / 2**20, 1) if mem else None, "gpu": gpu},
            "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "commit": git("rev-parse", "--short", "HEAD") + ("+uncommitted" if git("status", "--porcelain") else "")}


def train_options(manifest, data: Path, work: Path, workers: int, epochs: int) -> dict:
    """What the train stage gives speculators (eyrie_trainer.runner.TrainRunner._options), for this slice."""
    p, extract = manifest.train, manifest.extract
    options = {"verifier_name_or_path": manifest.target.model, "data_path": str(data),
               "save_path": str(work / "checkpoints"), "epochs": epochs, "ttt_steps": p.ttt_steps, "lr": p.lr,
               "total_seq_len": p.total_seq_len, "num_workers": workers, "target_layer_ids": list(extract.aux_layers),
               "log_dir": str(work / "logs"), "logger": "", "checkpoint_freq": 1, "log_freq": 1,
               "hidden_states_backend": "fp8" if extract.dtype == "fp8" else "file",
               "draft_vocab_size": p.draft_vocab, "num_layers": p.num_layers}
    return options | ({"max_steps": p.max_steps} if p.max_steps else {})


def train(options: dict, device: str, fast_path: bool) -> tuple[dict, float, Path]:
    """Train from scratch; the path taken, the wall seconds and the last epoch's checkpoint."""
    save = Path(options["save_path"])
    shutil.rmtree(save, ignore_errors=True)  # speculators would resume from a checkpoint left there
    hooks, started = engine.Hooks(), time.monotonic()
    path, wall = engine.train_with_fallback(options, device, fast_path, hooks, print), time.monotonic() - started
    epochs = [f.parent for f in save.glob("*/model.safetensors") if f.parent.name.isdigit()]  # speculators' layout
    if hooks.state.get("interrupted") or not epochs:
        raise SystemExit(f"training was interrupted, or speculators saved no epoch checkpoint in {save}.")
    return path, wall, max(epochs, key=lambda d: int(d.name))


def judge(checkpoint: Path, manifest, eval_dir: Path, out: Path, k: int, device: str) -> dict:
    """eyrie's acceptance length of a checkpoint (as export.evaluate reads it), and its directory as vLLM loads it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(_served_config(json.loads((checkpoint / "config.json").read_text()), manifest))
    shutil.copyfile(checkpoint / "model.safetensors", out / "model.safetensors")
    tau = simulate(load_drafter(checkpoint), eval_dir, k=k, device=device,
                   transfer=_transfer(eval_dir, manifest.extract.dtype))
    gc.collect()
    torch.cuda.empty_cache()  # vLLM takes the GPU next (a no-op where CUDA was never used)
    return {"checkpoint": str(checkpoint), "drafter": out, "eyrie_tau": tau["tau"],
            "eyrie": {key: tau[key] for key in ("per_position_acceptance", "drafts", "samples")}}


def verify_all(settings, store, a, manifest, drafters: dict[str, Path], logs: Path) -> tuple[dict, dict, dict]:
    """vLLM: the target alone once, then each drafter; per drafter its wall seconds and figures per set."""
    target, flags = manifest.target.model, serve_flags(settings, stored_config(store, a.run))
    sets = {HELDOUT: heldout_prompts(store, a.run, Path(settings.cache_dir))[:a.prompts],
            **benchmark_prompts(target, [b for b in a.bench.split(",") if b], a.prompts)}
    limits = answer_limits(sets, a.max_tokens, max_model_len(flags))
    logs.mkdir(parents=True, exist_ok=True)
    with Served(settings, target, flags, logs / "target.log") as server:
        alone = server.measure(sets, limits, SERIAL)
    results = {}
    for label, folder in drafters.items():
        spec = json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": a.k})
        print(f"vLLM: {target} with drafter {label} (eagle3, K={a.k})", flush=True)
        started = time.monotonic()
        with Served(settings, target, [*flags, "--speculative-config", spec], logs / f"{label}.log") as server:
            drafted = server.measure(sets, limits, SERIAL)
        results[label] = {"verify_s": time.monotonic() - started, "sets": {
            name: benchmark_result(alone[name], {a.k: drafted[name]}, len(sets[name]))["k"][str(a.k)] for name in sets}}
    return {n: len(p) for n, p in sets.items()}, {n: alone[n]["tokens_per_s"] for n in sets}, results


def recorded_stage_times(store, manifest) -> dict:
    """Generation and extraction: their shard manifests in the store, where every shard has finished."""
    layout, stages = Layout(manifest.run), ("generate", "extract")
    keys = {stage: [layout.shard_manifest(stage, p.index) for p in manifest.generate_shards] for stage in stages}
    return {stage: stage_time([store.get_json(k) for k in ks]) if all(map(store.exists, ks))
            else {"n/a": "not every shard has its manifest in the store: the stage has not finished"}
            for stage, ks in keys.items()}


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run already generated and extracted")
    p.add_argument("--sizes", required=True, help="training prompts per slice, comma-separated: 1000,2000,4k")
    p.add_argument("--bench", default="mt-bench,gsm8k,humaneval", help="benchmark sets beside the held-out prompts")
    p.add_argument("--prompts", type=int, default=40, help="prompts per benchmark")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length in vLLM")
    p.add_argument("--k", type=int, help="draft length K (default: the run's ttt_steps)")
    p.add_argument("--epochs", type=int, help="eyrie's epochs (default: the run's train.epochs)")
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True, help="speculators' defaults too")
    p.add_argument("--anchor-epochs", type=int, help="the anchor's epochs (default: eyrie's; speculators' own: 20)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learning_curve.json")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    a = p.parse_args(argv)
    a.sizes = [int(float(s[:-1]) * 1000) if s.lower().endswith("k") else int(s) for s in a.sizes.split(",") if s]
    a.command = "python bench/learning_curve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> None:
    a, settings = parse_args(argv), load_settings()
    store, device = open_store(settings), pick_device(settings.device)
    manifest = load_run_manifest(store, a.run)
    if manifest.train is None or manifest.extract is None or manifest.train.base:
        raise SystemExit(f"run {a.run} has no train plan yet (run the pipeline until training starts), or finetunes "
                         "a base drafter (the learning curve trains from scratch).")
    a.k, a.epochs = a.k or manifest.train.ttt_steps, a.epochs or manifest.train.epochs
    held = heldout_ids(samples := done_samples(store, a.run), manifest.train.heldout_samples)
    (pool, chosen), work = slices(samples, held, a.sizes), Path(settings.cache_dir) / "bench" / a.run
    eval_dir = Path(settings.cache_dir) / "runs" / a.run / "data" / "heldout"  # where eyrie verify reads it too
    materialize(store, a.run, eval_dir, lambda s: s["sample_id"] in held)
    fast = {"on": True, "off": False}.get(settings.train_fast_path, device.startswith("cuda"))  # as the train stage
    workers = settings.train_loader_workers if settings.train_loader_workers is not None else 2 * (device != "cpu")
    points, largest = [], max(chosen)
    for n, ids in chosen.items():
        wanted, data = set(ids), work / str(n) / "data"
        print(f"{n} training prompts: materializing, then training ({a.epochs} epochs, {device})", flush=True)
        materialize(store, a.run, data, lambda s: s["sample_id"] in wanted)
        path, wall, ckpt = train(train_options(manifest, data, work / str(n), workers, a.epochs), device, fast)
        points.append({"label": str(n), "prompts": n, "epochs": a.epochs, "train_s": wall, "path": path,
                       **judge(ckpt, manifest, eval_dir, work / str(n) / "drafter", a.k, device)})
        if n != largest:
            shutil.rmtree(data)  # each slice is a copy of its hidden states: the largest is kept for the anchor
    anchor = anchor_run(manifest, work, largest, device, workers, a.anchor_epochs or a.epochs, a.epochs, a.k,
                        eval_dir) if a.anchor else None
    drafted = points + ([anchor] if anchor else [])
    sets, alone, verified = verify_all(settings, store, a, manifest, {p["label"]: p["drafter"] for p in drafted},
                                       work / "vllm")
    for point in drafted:
        point.update(verified[point["label"]])
    result = {"run": a.run, "target": manifest.target.model, "target_name": Path(manifest.target.model).name,
              "command": a.command, **machine(), "device": device, "heldout_samples": len(held), "pool": len(pool),
              "sizes": list(chosen), "epochs": a.epochs, "k": a.k, "max_tokens": a.max_tokens, "sets": sets,
              "target_tokens_per_s": alone, "stage_times": recorded_stage_times(store, manifest),
              "points": points, "anchor": anchor}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=str))
    svg = a.out.with_suffix(".svg")
    svg.write_text(svg_plot({s: [(p["prompts"], p["sets"][s]["vllm_acceptance_length"]) for p in points] for s in sets},
                            f"{result['target_name']}: vLLM acceptance length, K={a.k}"))
    write_section(a.results, section(result, os.path.relpath(svg, a.results.parent)))
    print("\n".join(section(result)))


def anchor_run(manifest, work: Path, n: int, device: str, workers: int, epochs: int, eyrie_epochs: int, k: int,
               eval_dir: Path) -> dict:
    """speculators' defaults on the largest slice: of eyrie's options only what speculators requires and what this
    machine needs (GIVEN; sdpa + eager loss off a GPU). Which defaults it took is recorded."""
    from speculators.train.config import TrainConfig  # heavy: only for the anchor

    eyrie = train_options(manifest, work / str(n) / "data", work / "anchor", workers, epochs)
    options = {key: v for key, v in eyrie.items() if key in GIVEN or (key, v) == ("hidden_states_backend", "fp8")}
    print(f"anchor: speculators' defaults on the {n} training prompts ({epochs} epochs)", flush=True)
    path, wall, ckpt = train(options, device, device.startswith("cuda"))  # its fast path is its default
    given = options | ({key: path[key] for key in engine.SAFE_PATH} if path["path"] != "fast" else {})
    flat, own = engine.speculators_config(given).flatten(), TrainConfig().flatten()
    note = ("draft_vocab_size None: the verifier's full vocabulary. " if flat["draft_vocab_size"] is None else "") + (
        f"Epochs {epochs} where speculators' default is {own['epochs']} (--anchor-epochs; default: eyrie's "
        f"{eyrie_epochs}, so both train as long)." if epochs != own["epochs"] else "")
    return {"label": "anchor", "prompts": n, "epochs": epochs, "train_s": wall, "path": path, "note": note,
            "given": given, "defaults": {key: flat[key] for key in NOTABLE if key not in given},
            **judge(ckpt, manifest, eval_dir, work / "anchor" / "drafter", k, device)}


if __name__ == "__main__":
    main()
