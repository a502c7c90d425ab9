"""Finetuning from a base drafter, measured: a base trained on one category of a run's mix, finetuned on the
whole slice, against the same slice from scratch, at equal optimizer steps and at half of them.

  .venv/bin/python bench/finetune.py --run RUN --size 1k --base-category math      (--help: every option)
On a run generated and extracted (EYRIE_* as for every eyrie command; bench/real_model.py's home for its runs).
Slice n is bench/learning_curve.py's (the first n training samples by sample id); each point is trained by eyrie's
engine with the train stage's options, judged by eyrie's τ on the held-out samples and served by vLLM as the
learning curve serves its points (its measurements are shared: what one script measured the other reuses).
  scratch     slice n from scratch, the recipe its tokens choose: S optimizer steps (the learning curve's own point)
  base        the slice's samples of one category (e.g. math) from scratch, their own recipe
  finetune    from the base (speculators' from_pretrained, the base's own draft vocabulary) on slice n: S steps
  finetune/2  the same at S/2 steps (max_steps: the learning rate decays over the shorter budget; --budgets 0.5:
              this one alone)
Writes --out (JSON) and a section of --results. A rerun continues: points judged in an earlier sitting are reused.
"""

import argparse, json, shlex, sys
from pathlib import Path

import learning_curve as lc
from results import write_section

from eyrie.core.config import load_settings
from eyrie.data.manifest import load_run_manifest
from eyrie.data.store import open_store
from eyrie.work.gpu import pick_device
from eyrie_trainer import engine
from eyrie_trainer.base import prepare_base, save_vocab_mapping
from eyrie_trainer.data import done_samples, heldout_ids, materialize
from eyrie_trainer.runner import speculators_options

ROOT = Path(__file__).resolve().parent.parent
GOAL_GAP = 0.05  # issue 40: the from-scratch acceptance within 0.05 at half the optimizer steps


def categories(manifest) -> dict[int, str]:
    """Each dataset row's `category` (the general mix's field), by row number."""
    source = Path(manifest.dataset.source)
    rows = (source if source.is_absolute() else ROOT / source).read_text().splitlines()
    return {i: json.loads(row).get("category", "") for i, row in enumerate(rows)}


class Trainer:
    """Trains and judges one point in its folder (kept between sittings as the learning curve keeps its slices)."""

    def __init__(self, store, manifest, held: set[str], eval_dir: Path, device: str, k: int):
        self.store, self.manifest, self.held, self.eval_dir, self.device, self.k = store, manifest, held, eval_dir, device, k
        self.workers, self.fast = engine.loader_workers(load_settings(), device), engine.fast_path(load_settings(), device)

    def options(self, samples: list[dict], folder: Path, **extra) -> dict:
        params, _ = lc.slice_params(self.manifest, samples, self.device, None)
        rows = (len(samples), len(self.held))
        return speculators_options(params, self.manifest, folder / "data", folder, self.workers, rows, self.device) | extra

    def point(self, label: str, samples: list[dict], folder: Path, options: dict, data: Path | None = None) -> dict:
        if (kept := lc.kept_point(folder, options)) is not None:
            print(f"{label}: reused (trained and judged in an earlier sitting)", flush=True)
            return kept
        wanted = {s["sample_id"] for s in samples}
        if data is None:
            materialize(self.store, self.manifest.run, folder / "data", lambda s: s["sample_id"] in wanted,
                        validation=lambda s: s["sample_id"] in self.held, linked_from=self.eval_dir)
        print(f"{label}: training on {len(samples)} samples ({options.get('max_steps') or options['epochs']} "
              f"{'steps' if options.get('max_steps') else 'epochs'}; {self.device})", flush=True)
        path, wall, ckpt = lc.train(options, self.device, self.fast)
        return lc.keep_point(folder, {"label": label, "prompts": len(samples), "epochs": options["epochs"],
                                      "train_s": wall, "steps": lc.steps_of(ckpt), "path": path,
                                      **lc.judge(ckpt, self.manifest, self.eval_dir, folder / "drafter", self.k,
                                                 self.device)})


def points(store, manifest, a) -> list[dict]:
    settings, device = load_settings(), pick_device(load_settings().device)
    samples = done_samples(store, a.run)
    held = heldout_ids(samples, manifest.train.heldout_samples)
    _, chosen = lc.slices(samples, held, [a.size])
    by_id, of_row = {s["sample_id"]: s for s in samples}, categories(manifest)
    slice_n = [by_id[i] for i in chosen[a.size]]
    base_rows = [s for s in slice_n if of_row.get(s["row"]) == a.base_category]
    if not base_rows:
        raise SystemExit(f"slice {a.size} holds no sample of category {a.base_category!r}: name one of "
                         f"{sorted(set(of_row.values()))}.")
    work = Path(settings.cache_dir) / "bench" / a.run
    eval_dir = Path(settings.cache_dir) / "runs" / a.run / "data" / "heldout"
    materialize(store, a.run, eval_dir, lambda s: s["sample_id"] in held)
    t = Trainer(store, manifest, held, eval_dir, device, a.k or manifest.train.ttt_steps)
    scratch_dir = work / str(a.size)  # the learning curve's own folder for this slice: its point is reused
    scratch = t.point(str(a.size), slice_n, scratch_dir, t.options(slice_n, scratch_dir))  # the curve's label
    steps = scratch.get("steps") or lc.steps_of(Path(scratch["checkpoint"]))
    base_dir = work / "finetune" / f"base-{a.base_category}-{a.size}"
    base = t.point(f"base: {len(base_rows)} {a.base_category}", base_rows, base_dir, t.options(base_rows, base_dir))
    ready, _ = prepare_base(str(base["drafter"]), None, manifest.target.model, list(manifest.extract.aux_layers),
                            manifest.train.draft_vocab, Path(settings.cache_dir) / "base")
    data = work / "finetune" / f"slice-{a.size}"
    wanted = {s["sample_id"] for s in slice_n}
    if not (data / "done").exists():
        materialize(store, a.run, data, lambda s: s["sample_id"] in wanted, validation=lambda s: s["sample_id"] in held,
                    linked_from=eval_dir)
        (data / "done").touch()
    tuned = []
    for budget in (round(steps * f) for f in a.budgets):
        folder = work / "finetune" / f"from-{a.base_category}-{a.size}-{budget}"
        d2t, t2d = save_vocab_mapping(ready, folder / "base-vocab")
        options = t.options(slice_n, folder, data_path=str(data), from_pretrained=str(ready), d2t_path=str(d2t),
                            t2d_path=str(t2d), max_steps=budget)
        options.pop("num_layers", None)  # the base defines its own decoder (speculators refuses both)
        tuned.append(t.point(f"finetuned from the base, {budget} steps", slice_n, folder, options, data=data))
    return [{**scratch, "steps": steps}, base, *tuned]


def section(r: dict) -> list[str]:
    sets = list(r["points"][0]["sets"])
    out = [f"# Finetuning from a base drafter: {r['run']}, slice {r['size']}, base on its {r['base_category']} rows",
           "", f"- `{r['command']}`, {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), {r['date']}, commit "
           f"`{r['commit']}`; vLLM at K = {r['k']}, {r['prompts']} prompts a set, {r['max_tokens']} tokens.", "",
           "| drafter | samples | optimizer steps | train min | eyrie τ (held out) | " + " | ".join(sets) + " |",
           "|---|---|---|---|---|" + "---|" * len(sets)]
    for p in r["points"]:
        out.append(f"| {p['label']} | {p['prompts']} | {p.get('steps')} | {p['train_s'] / 60:.1f} | "
                   f"{p['eyrie_tau']:.2f} | " + " | ".join(lc._f(p["sets"][s]["vllm_acceptance_length"])
                                                             for s in sets) + " |")
    scratch, half = r["points"][0], r["points"][-1]
    gaps = {s: half["sets"][s]["vllm_acceptance_length"] - scratch["sets"][s]["vllm_acceptance_length"] for s in sets}
    held = all(g >= -GOAL_GAP for g in gaps.values())
    return out + ["", f"- Finetuned at {half['steps']} steps (half) against from scratch at {scratch['steps']}: "
                  + ", ".join(f"{s} {g:+.2f}" for s, g in gaps.items())
                  + f". Goal (within {GOAL_GAP} of from scratch on every set): {'holds' if held else 'does not hold'}."]


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run already generated and extracted")
    p.add_argument("--size", required=True, help="training samples of the slice (1000 or 1k)")
    p.add_argument("--base-category", default="math", help="the base drafter's category of the mix")
    p.add_argument("--bench", default="mt-bench,gsm8k,humaneval", help="benchmark sets beside the held-out prompts")
    p.add_argument("--prompts", type=int, default=40, help="prompts per benchmark")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length in vLLM")
    p.add_argument("--k", type=int, help="draft length K (default: the run's ttt_steps)")
    p.add_argument("--budgets", default="1,0.5", help="the finetunes' optimizer steps as shares of the from-scratch "
                   "point's, the goal's own (half) last; 0.5 alone saves a sitting the full-length one")
    p.add_argument("--out", type=Path, help="JSON (default: EYRIE_CACHE_DIR/../results/RUN-finetune.json)")
    p.add_argument("--results", type=Path, help="Markdown (default: RESULTS.md beside --out)")
    a = p.parse_args(argv)
    a.size = int(float(a.size[:-1]) * 1000) if a.size.lower().endswith("k") else int(a.size)
    a.budgets = [float(f) for f in a.budgets.split(",")]
    a.command = "python bench/finetune.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> None:
    a, settings = parse_args(argv), load_settings()
    store = open_store(settings)
    manifest = load_run_manifest(store, a.run)
    a.k = a.k or manifest.train.ttt_steps
    drafted = points(store, manifest, a)
    work = Path(settings.cache_dir) / "bench" / a.run
    sets, _, verified = lc.verify_all(settings, store, a, manifest, {p["label"]: p["drafter"] for p in drafted},
                                      work / "vllm")
    for point in drafted:
        point.update(verified[point["label"]])
    result = {"run": a.run, "size": a.size, "base_category": a.base_category, "command": a.command, **lc.machine(),
              "k": a.k, "prompts": a.prompts, "max_tokens": a.max_tokens, "sets": sets, "points": drafted}
    out = a.out or Path(settings.cache_dir).parent / "results" / f"{a.run}-finetune.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    write_section(a.results or out.parent / "RESULTS.md", section(result))
    print("\n".join(section(result)))


if __name__ == "__main__":
    main()
