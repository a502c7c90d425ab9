"""Learning curve: how a drafter's quality and cost grow with training data, measured by vLLM.

  .venv/bin/python bench/learning_curve.py --run RUN --sizes 1000,2000,4000,8000     (--help: every option)
On a run the pipeline has generated and extracted (EYRIE_* as for every eyrie command; no worker on the GPU). Held
out: the pipeline's own samples; slice n: the first n of the others sorted by sample id (a hash), so slices nest.
Each slice: trained by eyrie's engine with the train stage's options and the recipe its own training tokens choose
(timed), its last epoch's checkpoint judged by eyrie (evaluate.simulate, held out) and written as a drafter vLLM loads. The anchor: speculators' own entry point and
defaults on the largest slice, given only what it requires and what the machine needs. vLLM, as `eyrie verify`: the
target alone once, then each drafter (eagle3, K), on the held-out prompts and the benchmarks. Generation and
extraction times: the run's shard manifests. Writes --out (JSON), an SVG plot beside it, a section of --results.
A rerun continues (EYRIE_CACHE_DIR/bench/RUN/): a slice judged in an earlier sitting is reused, an interrupted training
resumes from its checkpoints, vLLM measures only what no sitting has (bench/real_model.py runs it across sittings).
"""

import argparse, datetime as dt, gc, json, os, platform, re, shlex, shutil, subprocess, sys, time
from pathlib import Path

import torch

from eyrie.core import recipe as recipes
from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.stages.run_config import stored_config
from eyrie.data.store import open_store
from eyrie.work.gpu import pick_device
from eyrie_trainer import checkpoints, engine
from eyrie_trainer.data import done_samples, heldout_ids, materialize
from eyrie_trainer.evaluate import simulate
from eyrie_trainer.export import download, load_drafter, served_config, states_transfer
from eyrie_trainer.runner import speculators_options
from eyrie.data.verify_outputs import set_blocks
from eyrie_trainer.verify import (HELDOUT, Served, answer_limits, benchmark_result, benchmark_sets, heldout_prompts,
                                  max_model_len, serve_flags)

from learning_report import NOTABLE, section, svg_plot
from learning_report import cell as _f  # noqa: F401 (bench/finetune.py, run by a measurement as it is, reads lc._f)
from results import write_section

ROOT = Path(__file__).resolve().parent.parent
SERIAL = 4  # prompts answered one at a time, for tokens/s at 1 in flight
GIVEN = {"verifier_name_or_path", "data_path", "save_path", "target_layer_ids", "log_dir", "num_workers", "epochs",
         "train_data_ratio", "hidden_states_dtype"}  # the training split is the slice, the validation split the held-out
# samples (train_data_ratio); fp32 where the CPU has no native bf16 (hidden_states_dtype: 60x faster here)


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
    return {"wall_s": wall, "prompts": done, "shards": len(shards), "s_per_1k": wall / done * 1000 if done else None,
            "finished_at": max(dt.datetime.fromisoformat(s["finished_at"]) for s in shards).isoformat()}


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


def slice_params(manifest, samples: list[dict], device: str, epochs: int | None):
    """The run's train plan for a slice: its recipe chosen from the slice's own training tokens, as the train stage
    plans a run of that size (epochs given: those); returns the plan and its recipe."""
    p = manifest.train
    pack = recipes.pack_length(p.total_seq_len, device)
    recipe = recipes.choose(sum(min(s["seq_len"], pack) for s in samples), device, lr=p.lr, warmup=p.warmup,
                            schedule=p.schedule, seq_len=p.total_seq_len, epochs=epochs)
    return p.model_copy(update={"epochs": recipe.epochs, "train_samples": len(samples)}), recipe


def kept_point(folder: Path, options: dict) -> dict | None:
    """A slice's point from an earlier sitting trained with the same options (None: not yet judged). Options
    that differ from the last sitting's clear its checkpoints, point and train time: nothing is resumed from them."""
    marker, point = folder / "options.json", folder / "point.json"
    wanted = json.loads(json.dumps(options, default=str))
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return json.loads(point.read_text()) if point.exists() else None
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    point.unlink(missing_ok=True)
    (folder / "train_s").unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(wanted, indent=1))
    return None


def keep_point(folder: Path, point: dict) -> dict:
    (folder / "point.json").write_text(json.dumps(point, indent=1, default=str))
    return point


def epoch_checkpoints(save: Path) -> list[Path]:
    return [f.parent for f in save.glob("*/model.safetensors") if f.parent.name.isdigit()]  # speculators' layout


def train(options: dict, device: str, fast_path: bool) -> tuple[dict, float, Path]:
    """Train, resuming from the checkpoints an earlier sitting left in save_path (kept_point cleared any of
    other options); the path taken, the wall seconds of every sitting and the last epoch's checkpoint."""
    save = Path(options["save_path"])
    spent = save.parent / "train_s"
    before = float(spent.read_text()) if spent.exists() else 0.0
    hooks, started = engine.Hooks(), time.monotonic()
    try:
        path = engine.train_with_fallback(options, device, fast_path, hooks, print)
    finally:
        wall = before + time.monotonic() - started
        spent.write_text(str(wall))
    epochs = epoch_checkpoints(save)
    if hooks.state.get("interrupted") or not epochs:
        raise SystemExit(f"training was interrupted (rerun the command: it resumes from {save}), or speculators "
                         f"saved no epoch checkpoint in {save}.")
    return path, wall, max(epochs, key=lambda d: int(d.name))


def steps_of(checkpoint: Path) -> int | None:
    state = checkpoint / "training_state.json"  # speculators' record of where a checkpoint stands
    return json.loads(state.read_text())["global_step"] if state.exists() else None


def run_point(store, manifest, folder: Path, n: int) -> dict | None:
    """The whole training pool is the run's own training set: its train stage's exported drafter (the best epoch
    by held-out τ) and evaluation are the point, not trained again (None: the run has no drafter yet). Train time:
    the end of extraction to the last epoch checkpoint's upload (data preparation in, evaluation and export not)."""
    layout = Layout(manifest.run)
    if not store.exists(layout.drafter_manifest):
        return None
    print(f"{n} training prompts: the run's own training set: its exported drafter, not trained again", flush=True)
    record = download(store, manifest.run, folder / "drafter")
    evaluation = store.get_json(layout.evaluation)
    best = next(c for c in evaluation["checkpoints"] if c["label"] == record["checkpoint"])
    extracted = recorded_stage_times(store, manifest)["extract"]
    last = max((m for m in checkpoints.stored(store, layout) if m["local_step"] == 0), key=lambda m: m["epoch"])
    train_s = (dt.datetime.fromisoformat(last["saved_at"]) - dt.datetime.fromisoformat(extracted["finished_at"])
               ).total_seconds()
    return {"label": str(n), "prompts": n, "epochs": manifest.train.epochs, "train_s": train_s, "recipe": manifest.train.recipe,
            "steps": _stored_steps(store, layout, record["checkpoint"], folder / "checkpoint-state"),
            "path": record["training_path"], "checkpoint": f"the run's {record['checkpoint']} (best of "
            f"{len(evaluation['checkpoints'])} by held-out τ)", "drafter": folder / "drafter", "eyrie_tau": best["tau"],
            "eyrie": {key: best[key] for key in ("per_position_acceptance", "drafts", "samples")}, "from_run": True}


def _stored_steps(store, layout: Layout, label: str, folder: Path) -> int | None:
    """Optimizer steps at a run's stored checkpoint (speculators' training_state.json, as uploaded)."""
    saved = [m for m in checkpoints.stored(store, layout) if m["label"] == label and "training_state.json" in m["files"]]
    return steps_of(checkpoints.fetch(store, layout, saved[-1], folder, ["training_state.json"])) if saved else None


def judge(checkpoint: Path, manifest, eval_dir: Path, out: Path, k: int, device: str) -> dict:
    """eyrie's acceptance length of a checkpoint (as export.evaluate reads it), and its directory as vLLM loads it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(served_config(json.loads((checkpoint / "config.json").read_text()), manifest))
    shutil.copyfile(checkpoint / "model.safetensors", out / "model.safetensors")
    tau = simulate(load_drafter(checkpoint), eval_dir, k=k, device=device,
                   transfer=states_transfer(eval_dir, manifest.extract.dtype))
    gc.collect()
    torch.cuda.empty_cache()  # vLLM takes the GPU next (a no-op where CUDA was never used)
    return {"checkpoint": str(checkpoint), "drafter": out, "eyrie_tau": tau["tau"],
            "eyrie": {key: tau[key] for key in ("per_position_acceptance", "drafts", "samples")}}


def measured(cache: Path, key: dict, label: str, measure):
    """`measure()`'s figures under `label`, kept in `cache` between sittings while `key` (what was asked) is the
    same: a rerun serves only what no sitting has measured yet."""
    key = json.loads(json.dumps(key, default=str))
    kept = json.loads(cache.read_text()) if cache.exists() else {}
    kept = kept if kept.get("key") == key else {"key": key, "measured": {}}
    if label in kept["measured"]:
        print(f"vLLM: {label}: reused (measured in an earlier sitting)", flush=True)
        return kept["measured"][label]
    kept["measured"][label] = json.loads(json.dumps(measure(), default=str))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(kept, indent=1))
    return kept["measured"][label]


def forget_measured(cache: Path, label: str) -> None:
    """A drafter trained anew: its figures from an earlier sitting no longer hold."""
    if cache.exists():
        kept = json.loads(cache.read_text())
        if kept.get("measured", {}).pop(label, None) is not None:
            cache.write_text(json.dumps(kept, indent=1))


def verify_all(settings, store, a, manifest, drafters: dict[str, Path], logs: Path) -> tuple[dict, dict, dict]:
    """vLLM: the target alone once, then each drafter; per drafter its wall seconds and figures per set (each kept
    in logs/measured.json: a rerun measures only what is missing). MT-Bench is asked its second turns too, as
    `eyrie verify` asks them: its second turn and both turns are sets of their own here ('mt-bench turn 2',
    'mt-bench turns 1+2'; 'mt-bench' is its first turn)."""
    target, flags = manifest.target.model, serve_flags(settings, stored_config(store, a.run))
    benches, second_turns = benchmark_sets(target, [b for b in a.bench.split(",") if b], a.prompts, a.max_tokens,
                                           max_model_len(flags))
    sets = {HELDOUT: heldout_prompts(store, a.run, Path(settings.cache_dir))[:a.prompts], **benches}
    limits = answer_limits(sets, a.max_tokens, max_model_len(flags))
    logs.mkdir(parents=True, exist_ok=True)
    cache = logs / "measured.json"
    key = {"sets": sets, "limits": limits, "flags": flags, "k": a.k, "second_turns": list(second_turns)}

    def alone_measure():
        with Served(settings, target, flags, logs / "target.log") as server:
            return server.measure(sets, limits, SERIAL, second_turns)

    alone, results = measured(cache, key, "target alone", alone_measure), {}
    for label, folder in drafters.items():
        def drafted_measure(label=label, folder=folder):
            spec = json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": a.k})
            print(f"vLLM: {target} with drafter {label} (eagle3, K={a.k})", flush=True)
            started = time.monotonic()
            with Served(settings, target, [*flags, "--speculative-config", spec], logs / f"{label}.log") as server:
                drafted = server.measure(sets, limits, SERIAL, second_turns)
            return {"verify_s": time.monotonic() - started, "sets": {
                shown: figures["k"][str(a.k)] for shown, figures in set_blocks(
                    {name: benchmark_result(alone[name], {a.k: drafted[name]}, len(sets[name])) for name in sets})}}
        results[label] = measured(cache, key, label, drafted_measure)
    alone_only = set_blocks({name: benchmark_result(alone[name], {}, len(sets[name])) for name in sets})
    return ({shown: figures["prompts"] for shown, figures in alone_only},
            {shown: figures["tokens_per_s_target"] for shown, figures in alone_only}, results)


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
    p.add_argument("--epochs", type=int, help="eyrie's epochs for every slice (default: each slice's recipe, chosen "
                                                 "from its training tokens as the train stage plans a run that size)")
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True, help="speculators' defaults too")
    p.add_argument("--anchor-epochs", type=int, help="the anchor's epochs (default: eyrie's; speculators' own: 20)")
    p.add_argument("--anchor-steps", type=int, help="the anchor stopped at this many steps (its max_steps; epochs: "
                                                    "speculators' own unless --anchor-epochs)")
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
    a.k = a.k or manifest.train.ttt_steps
    held = heldout_ids(samples := done_samples(store, a.run), manifest.train.heldout_samples)
    (pool, chosen), work = slices(samples, held, a.sizes), Path(settings.cache_dir) / "bench" / a.run
    eval_dir = Path(settings.cache_dir) / "runs" / a.run / "data" / "heldout"  # where eyrie verify reads it too
    n_eval = materialize(store, a.run, eval_dir, lambda s: s["sample_id"] in held)
    fast, workers = engine.fast_path(settings, device), engine.loader_workers(settings, device)  # as the train stage
    by_id, points, largest, measured_at = {s["sample_id"]: s for s in samples}, [], max(chosen), work / "vllm"
    for n, ids in chosen.items():
        params, recipe = slice_params(manifest, [by_id[i] for i in ids], device, a.epochs)
        wanted, folder = set(ids), work / str(n)
        if n == len(pool) and (point := run_point(store, manifest, folder, n)) is not None:
            points.append(point)
            continue
        options = speculators_options(params, manifest, folder / "data", folder, workers, (n, n_eval), device)
        if (point := kept_point(folder, options)) is not None:
            print(f"{n} training prompts: reused (trained and judged in an earlier sitting)", flush=True)
            points.append(point)
            continue
        forget_measured(measured_at / "measured.json", str(n))
        resumed = epoch_checkpoints(folder / "checkpoints")
        print(f"{n} training prompts: materializing, then training ({recipe.statement()}; {device})"
              + (f"; resuming from its checkpoint of epoch {max(int(d.name) for d in resumed)}" if resumed else ""),
              flush=True)
        materialize(store, a.run, folder / "data", lambda s: s["sample_id"] in wanted,
                    validation=lambda s: s["sample_id"] in held, linked_from=eval_dir)
        path, wall, ckpt = train(options, device, fast)
        points.append(keep_point(folder, {"label": str(n), "prompts": n, "epochs": params.epochs, "train_s": wall,
                                          "recipe": recipe.statement(), "path": path,
                                          **judge(ckpt, manifest, eval_dir, folder / "drafter", a.k, device)}))
        if n != largest:
            shutil.rmtree(folder / "data")  # each slice is a copy of its hidden states: the largest is kept for the anchor
    anchor = anchor_run(store, a.run, manifest, work, largest, [by_id[i] for i in chosen[largest]], held, eval_dir,
                        device, workers, a) if a.anchor else None
    drafted = points + ([anchor] if anchor else [])
    sets, alone, verified = verify_all(settings, store, a, manifest, {p["label"]: p["drafter"] for p in drafted},
                                       measured_at)
    for point in drafted:
        point.update(verified[point["label"]])
    result = {"run": a.run, "target": manifest.target.public_name(), "target_name": Path(manifest.target.model).name,
              "command": a.command, **machine(), "device": device, "heldout_samples": len(held), "pool": len(pool),
              "sizes": list(chosen), "epochs": "each slice's recipe" if a.epochs is None else a.epochs, "k": a.k,
              "max_tokens": a.max_tokens, "sets": sets, "target_tokens_per_s": alone,
              "stage_times": recorded_stage_times(store, manifest), "points": points, "anchor": anchor}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=str))
    svg = a.out.with_suffix(".svg")
    svg.write_text(svg_plot({s: [(p["prompts"], p["sets"][s]["vllm_acceptance_length"]) for p in points] for s in sets},
                            f"{result['target_name']}: vLLM acceptance length, K={a.k}"))
    write_section(a.results, section(result, os.path.relpath(svg, a.results.parent)))
    print("\n".join(section(result)))


def anchor_run(store, run: str, manifest, work: Path, n: int, samples: list[dict], held: set[str], eval_dir: Path,
               device: str, workers: int, a) -> dict:
    """speculators' defaults on the largest slice: of eyrie's options only what speculators requires and what this
    machine needs (GIVEN; sdpa + eager loss off a GPU). Which defaults it took is recorded."""
    from speculators.train.config import TrainConfig  # heavy: only for the anchor

    steps, own_epochs = getattr(a, "anchor_steps", None), TrainConfig().flatten()["epochs"]
    params, _ = slice_params(manifest, samples, device, a.anchor_epochs or (own_epochs if steps else a.epochs))
    data, folder, n_eval = work / str(n) / "data", work / "anchor", len(held)
    eyrie = speculators_options(params, manifest, data, folder, workers, (n, n_eval), device)
    options = {key: v for key, v in eyrie.items() if key in GIVEN or (key, v) == ("hidden_states_backend", "fp8")}
    options |= {"max_steps": steps} if steps else {}  # a budget: speculators decays its learning rate over it
    if (point := kept_point(folder, options)) is not None:
        print(f"anchor: reused (trained and judged in an earlier sitting)", flush=True)
        return point
    forget_measured(work / "vllm" / "measured.json", "anchor")
    wanted = {s["sample_id"] for s in samples}
    materialize(store, run, data, lambda s: s["sample_id"] in wanted, validation=lambda s: s["sample_id"] in held,
                linked_from=eval_dir)
    print(f"anchor: speculators' defaults on the {n} training prompts ({params.epochs} epochs)", flush=True)
    path, wall, ckpt = train(options, device, device.startswith("cuda"))  # its fast path is its default
    given = options | ({key: path[key] for key in engine.SAFE_PATH} if path["path"] != "fast" else {})
    flat, own = engine.speculators_config(given).flatten(), TrainConfig().flatten()
    note = ("draft_vocab_size None: the verifier's full vocabulary. " if flat["draft_vocab_size"] is None else "") + (
        f"max_steps {steps} (--anchor-steps): a step budget for the same CPU time. " if steps else "") + (
        f"Epochs {params.epochs} where speculators' default is {own['epochs']} (--anchor-epochs; default: eyrie's "
        f"for this slice, so both train as long)." if params.epochs != own["epochs"] else "")
    return keep_point(folder, {"label": "anchor", "prompts": n, "epochs": params.epochs, "train_s": wall,
                               "steps": steps_of(ckpt), "path": path, "note": note, "given": given,
                               "defaults": {key: flat[key] for key in NOTABLE if key not in given},
                               **judge(ckpt, manifest, eval_dir, folder / "drafter", a.k, device)})


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a SIGTERM stops vLLM as Ctrl-C does; a rerun continues


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    main()
