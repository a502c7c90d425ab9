"""Recipe sweep: other train settings on one run's own states, each judged by eyrie and by vLLM beside the run's drafter.

  .venv/bin/python bench/recipe_sweep.py --run RUN --recipes 'lr=3e-3;seq_len=2048;draft_vocab=4096' --anchor-steps 6
On a run the pipeline has trained (EYRIE_* as for every eyrie command; bench/run.smollm2-sweep.yaml makes one). Each
recipe (';'-separated; each a ','-separated list of train settings by `eyrie train`'s names) is the run's own train plan
with those settings changed, trained by eyrie's engine on the run's whole training set with its held-out samples as
validation (timed), its last epoch's checkpoint judged by eyrie (held-out τ) and by vLLM. The run's own drafter is the
first row, not trained again. --anchor-steps N: speculators' own defaults on the same states, stopped at N optimizer
steps (its max_steps: choose N for about the run's train time). vLLM, as bench/learning_curve.py: the target alone once,
then each drafter; a rerun continues (EYRIE_CACHE_DIR/bench/RUN/): a recipe judged in an earlier sitting is reused.
"""

import argparse, json, shlex, sys
from pathlib import Path

from pydantic import ValidationError

from eyrie.core.config import load_settings
from eyrie.core.stage_settings import TrainSettings
from eyrie.data.manifest import load_run_manifest
from eyrie.data.store import open_store
from eyrie.work.gpu import pick_device
from eyrie_trainer import engine
from eyrie_trainer.data import done_samples, heldout_ids, materialize
from eyrie_trainer.runner import speculators_options

import learning_curve as lc
from learning_report import cell, row
from results import write_section

SWEPT = ("lr", "warmup", "schedule", "seq_len", "draft_vocab", "ttt_steps", "epochs", "max_steps")
PLAN_NAMES = {"seq_len": "total_seq_len"}  # TrainSettings' name -> the train plan's (TrainParams)


def parse_recipes(text: str) -> dict[str, dict]:
    """'lr=3e-3;seq_len=2048,epochs=4' -> {label: settings}, each checked as `eyrie train` checks it."""
    recipes = {}
    for entry in (e.strip() for e in text.split(";") if e.strip()):
        pairs = [p.split("=", 1) for p in entry.split(",")]
        unknown = [p[0] for p in pairs if len(p) != 2 or p[0].strip() not in SWEPT]
        if unknown:
            raise SystemExit(f"recipe {entry!r}: {unknown} not a name=value of {', '.join(SWEPT)} "
                             f"(e.g. 'lr=3e-3;seq_len=2048,epochs=4').")
        given = {k.strip(): v.strip() for k, v in pairs}
        try:
            checked = TrainSettings.model_validate(given)
        except ValidationError as e:
            raise SystemExit(f"recipe {entry!r}: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
        recipes[entry.replace(" ", "")] = {k: getattr(checked, k) for k in given}
    return recipes


def recipe_params(plan, changes: dict):
    """The run's train plan with a recipe's settings changed."""
    return plan.model_copy(update={PLAN_NAMES.get(k, k): v for k, v in changes.items()})


def describe(p) -> str:
    return (f"lr {p.lr:g}, warmup {p.warmup:.0%}, {p.schedule}, {p.total_seq_len:,}-token packs, {p.epochs} epochs"
            + (f" (at most {p.max_steps} steps)" if p.max_steps else "")
            + f", draft vocabulary {p.draft_vocab:,}, TTT {p.ttt_steps}")


def recipe_point(label: str, params, manifest, store, run: str, data: Path, folder: Path, rows: tuple[int, int],
                 eval_dir: Path, device: str, workers: int, fast: bool, a, measured_at: Path) -> dict:
    options = speculators_options(params, manifest, data, folder, workers, rows, device)
    if (point := lc.kept_point(folder, options)) is not None:
        print(f"recipe {label}: reused (trained and judged in an earlier sitting)", flush=True)
        return point
    lc.forget_measured(measured_at / "measured.json", label)
    print(f"recipe {label}: training ({describe(params)}; {device})", flush=True)
    path, wall, ckpt = lc.train(options, device, fast)
    return lc.keep_point(folder, {"label": label, "prompts": rows[0], "epochs": params.epochs, "train_s": wall,
                                  "steps": lc.steps_of(ckpt), "recipe": describe(params), "path": path,
                                  **lc.judge(ckpt, manifest, eval_dir, folder / "drafter", a.k, device)})


def section(r: dict) -> list[str]:
    sets, m = list(r["sets"]), r["machine"]
    out = [f"# Recipe sweep: {r['run']} (bench/recipe_sweep.py)", "",
           f"- Machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM; {r['date']}; commit `{r['commit']}`.",
           f"- Command: `{r['command']}`",
           f"- {r['pool']} training samples, {r['heldout_samples']} held out (validation and eyrie's τ), on "
           f"{r['device']}; the run's plan: {r['plan']}. eyrie τ: a recipe's last epoch (the run's own: its best by "
           f"held-out τ). vLLM at K={r['k']}, greedy, at most {r['max_tokens']} tokens; "
           + ", ".join(f"{n} {c} prompts" for n, c in r["sets"].items()) + ".", "",
           row("recipe", "optimizer steps", "train min", "eyrie τ held out",
               *(f"vLLM {s}" for s in sets), *(f"speedup @1 {s}" for s in sets)),
           "|" + "---|" * (4 + 2 * len(sets))]
    for p in r["points"]:
        out.append(row(p["label"], p.get("steps") or "-", cell(p["train_s"] / 60, ".1f"), cell(p["eyrie_tau"]),
                       *(cell(p["sets"][s]["vllm_acceptance_length"]) for s in sets),
                       *(cell(p["sets"][s]["speedup"]["1"]) for s in sets)))
    return out + [""] + [f"- {p['label']}: {p.get('recipe') or p.get('note', '')}" for p in r["points"]]


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run the pipeline has trained")
    p.add_argument("--recipes", required=True, type=parse_recipes, help="e.g. 'lr=3e-3;seq_len=2048,epochs=4'")
    p.add_argument("--anchor-steps", type=int, help="speculators' defaults too, stopped at this many steps")
    p.add_argument("--bench", default="gsm8k", help="benchmark sets beside the held-out prompts")
    p.add_argument("--prompts", type=int, default=40, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length in vLLM")
    p.add_argument("--k", type=int, help="draft length K (default: the run's ttt_steps)")
    p.add_argument("--out", type=Path, default=lc.ROOT / "bench" / "results" / "recipe_sweep.json")
    p.add_argument("--results", type=Path, default=lc.ROOT / "bench" / "RESULTS.md")
    a = p.parse_args(argv)
    a.anchor_epochs = a.epochs = None  # learning_curve.anchor_run's: speculators' own epochs under --anchor-steps
    a.command = "python bench/recipe_sweep.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> None:
    a, settings = parse_args(argv), load_settings()
    store, device = open_store(settings), pick_device(settings.device)
    manifest = load_run_manifest(store, a.run)
    if manifest.train is None or manifest.train.base:
        raise SystemExit(f"run {a.run} has no train plan yet (run the pipeline until it has trained), or finetunes "
                         "a base drafter (the sweep trains from scratch).")
    a.k = a.k or manifest.train.ttt_steps
    held = heldout_ids(samples := done_samples(store, a.run), manifest.train.heldout_samples)
    pool = sorted(s["sample_id"] for s in samples if s["sample_id"] not in held)
    n, work = len(pool), Path(settings.cache_dir) / "bench" / a.run
    eval_dir = Path(settings.cache_dir) / "runs" / a.run / "data" / "heldout"
    n_eval = materialize(store, a.run, eval_dir, lambda s: s["sample_id"] in held)
    data, wanted, measured_at = work / str(n) / "data", set(pool), work / "vllm"
    materialize(store, a.run, data, lambda s: s["sample_id"] in wanted, validation=lambda s: s["sample_id"] in held,
                linked_from=eval_dir)
    fast, workers = engine.fast_path(settings, device), engine.loader_workers(settings, device)  # as the train stage
    own = lc.run_point(store, manifest, work / str(n), n)
    if own is None:
        raise SystemExit(f"run {a.run} has no exported drafter yet: let the pipeline finish training first.")
    points = [own | {"label": "the run's own recipe", "recipe": manifest.train.recipe or describe(manifest.train)}]
    for label, changes in a.recipes.items():
        folder = work / "recipes" / label.replace("/", "_")
        points.append(recipe_point(label, recipe_params(manifest.train, changes), manifest, store, a.run, data, folder,
                                   (n, n_eval), eval_dir, device, workers, fast, a, measured_at))
    if a.anchor_steps:
        by_id = {s["sample_id"]: s for s in samples}
        anchor = lc.anchor_run(store, a.run, manifest, work, n, [by_id[i] for i in pool], held, eval_dir, device,
                               workers, a)
        points.append(anchor | {"recipe": f"speculators' own defaults, stopped at {a.anchor_steps} steps. {anchor['note']}"})
    sets, _, verified = lc.verify_all(settings, store, a, manifest, {p["label"]: p["drafter"] for p in points},
                                      measured_at)
    for point in points:
        point.update(verified[point["label"]])
    result = {"run": a.run, "command": a.command, **lc.machine(), "device": device, "pool": n,
              "heldout_samples": len(held), "plan": describe(manifest.train), "k": a.k, "max_tokens": a.max_tokens,
              "sets": sets, "points": points}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=str))
    write_section(a.results, section(result))
    print("\n".join(section(result)))


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lc._interrupt)
    main()
