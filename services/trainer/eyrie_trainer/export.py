"""Evaluate every stored checkpoint on the held-out samples (τ: the mean acceptance length as vLLM
counts it, see eyrie_trainer.evaluate; with an untrained drafter of the
same shape as the baseline), mark the best, and export it: the directory vLLM loads with
`--speculative-config '{"method": "eagle3", "model": DIR, ...}'` (eyrie.core.vllm.eagle3_spec), stored under
train/drafter/. Its config names its method (`speculators_model_type: eagle3`, what vLLM reads when the folder
itself is served), and a reduced draft vocabulary goes only with its mapping (`d2t`, `t2d`)."""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from eyrie.core.errors import EyrieError
from eyrie.core.vllm import EAGLE3, eagle3_spec
from eyrie.data.manifest import Layout, load_run_manifest, now_iso
from eyrie_trainer import checkpoints
from eyrie_trainer.data import missing_states
from eyrie_trainer.evaluate import simulate, target_greedy, untrained_like

DRAFTER_FILES = ("config.json", "model.safetensors")


def load_drafter(folder: Path):
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel.from_pretrained(str(folder))


def states_transfer(eval_dir: Path, dtype: str):
    """How the held-out states in `eval_dir` are read: fp8 ones dequantized (FP8Transfer), others as stored (None)."""
    if dtype != "fp8":
        return None
    from hs_connectors.transfer import FP8Transfer

    return FP8Transfer(eval_dir / "hidden_states")


def evaluate(store, run: str, eval_dir: Path, device: str, log) -> dict:
    """τ per end-of-epoch checkpoint and for the untrained baseline; the best is marked."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    _require_states(eval_dir, manifest)
    k, transfer = manifest.train.ttt_steps, states_transfer(eval_dir, manifest.extract.dtype)
    stored = [m for m in checkpoints.stored(store, layout) if m["local_step"] == 0]
    if not stored:
        raise EyrieError(f"run {run} has no finished epoch checkpoint to evaluate.",
                         f"train it first: `eyrie train --run {run} --wait`.")
    results, baseline = [], None
    greedy = target_greedy(eval_dir, manifest.target.model, device, transfer)  # once, for every checkpoint
    for entry in stored:
        with tempfile.TemporaryDirectory() as tmp:
            model = load_drafter(checkpoints.fetch(store, layout, entry, Path(tmp), list(DRAFTER_FILES)))
        if baseline is None:
            baseline = simulate(untrained_like(model), eval_dir, k=k, device=device, transfer=transfer,
                                target=manifest.target.model, greedy=greedy)
            log(f"untrained baseline: tau {baseline['tau']:.3f}")
        result = simulate(model, eval_dir, k=k, device=device, transfer=transfer, target=manifest.target.model,
                          greedy=greedy)
        log(f"checkpoint {entry['label']}: tau {result['tau']:.3f} (K={k}, vLLM's bookkeeping; "
            f"every-position statistic {result['every_position']['tau']:.3f})")
        results.append({"label": entry["label"], "epoch": entry["epoch"], **result})
    best = max(results, key=lambda r: r["tau"])  # the acceptance length a server would see
    evaluation = {"k": k, "heldout_samples": manifest.train.heldout_samples, "baseline": baseline,
                  "checkpoints": results, "best": best["label"], "evaluated_at": now_iso()}
    store.put_json(layout.evaluation, evaluation)
    return evaluation


def _require_states(eval_dir: Path, manifest) -> None:
    """Every held-out sample's states in `eval_dir`: a run that stores some as token ids alone has
    them fetched from the extraction service by its train task (eyrie_trainer.data.fetch_missing_states)."""
    missing = missing_states(eval_dir)
    if missing:
        raise EyrieError(f"{len(missing)} held-out samples of run {manifest.run} have no hidden states in "
                         f"{eval_dir} (extract.storage {manifest.extract.storage}: the extraction service "
                         "makes them, and none fetched them here).",
                         "evaluate where the run trained (its EYRIE_CACHE_DIR holds them), or fetch them from "
                         "the running extraction service with eyrie_trainer.data.fetch_missing_states.")


def export(store, run: str, evaluation: dict, path: dict, samples: dict | None = None) -> dict:
    """The best checkpoint's config and weights to train/drafter/, and the run manifest's record
    of the drafter (written last: the proof that the stage is done)."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    label = evaluation["best"]
    entry = next(m for m in checkpoints.stored(store, layout) if m["label"] == label)
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoints.fetch(store, layout, entry, Path(tmp), list(DRAFTER_FILES))
        config = folder / "config.json"
        served = served_config(json.loads(config.read_bytes()), manifest)
        require_vocab_mapping(folder / "model.safetensors", json.loads(served), run)
        config.write_bytes(served)
        for name in DRAFTER_FILES:
            info = store.put_file(layout.drafter_file(name), folder / name)
            files[name] = {"key": info.key, "sha256": info.sha256, "bytes": info.size}
    best = next(c for c in evaluation["checkpoints"] if c["label"] == label)
    record = {"files": files, "checkpoint": label, "tau": best["tau"], "baseline_tau": evaluation["baseline"]["tau"],
              "per_position_acceptance": best["per_position_acceptance"],
              "tau_every_position": best["every_position"]["tau"],
              "k": evaluation["k"], "training_path": path, "exported_at": now_iso(),
              "vllm": vllm_command(manifest.target.public_name(), "DIR", evaluation["k"])}
    if samples is not None:  # what the trainer read (eyrie_trainer.ledger): trained, left out with why, cut
        record["samples"] = samples
    manifest.drafter = record
    store.put_json(layout.manifest, manifest.model_dump())
    store.put_json(layout.drafter_manifest, record)
    return record


def served_config(config: dict, manifest) -> bytes:
    """The checkpoint's config as vLLM reads it: its method named (EAGLE-3, whatever folder it is served from),
    the target by its public name (TargetRef.public_name: a hub id, never a path of this host), K proposal tokens
    (the TTT steps it was trained for)."""
    named = {config.get("speculators_model_type"), config["speculators_config"].get("algorithm")} - {None}
    if named - {EAGLE3}:
        raise EyrieError(f"run {manifest.run}'s best checkpoint is a {'/'.join(sorted(named))} speculator, "
                         "not EAGLE-3: eyrie exports and serves EAGLE-3 drafters only.",
                         "train the run again (`eyrie train`): eyrie's trainer writes EAGLE-3 checkpoints.")
    config["speculators_model_type"] = config["speculators_config"]["algorithm"] = EAGLE3
    config["speculators_config"]["verifier"]["name_or_path"] = manifest.target.public_name()
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = manifest.train.ttt_steps
    return json.dumps(config, indent=2).encode()


def require_vocab_mapping(weights: Path, config: dict, run: str) -> None:
    """A draft vocabulary smaller than the target's goes with its mapping: `d2t` (what vLLM reads: without
    it, its EAGLE-3 loader leaves the offsets at 0, so draft id i silently means the target's token i) and
    `t2d` (what speculators reads), each of its size, mapping to distinct target ids. Refused otherwise."""
    draft, target = config.get("draft_vocab_size"), config["transformer_layer_config"]["vocab_size"]
    if draft is None or draft == target:
        return
    with safe_open(str(weights), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in ("d2t", "t2d") if name in f.keys()}
    problem = _mapping_problem(tensors, draft, target)
    if problem:
        raise EyrieError(f"run {run}'s drafter has a draft vocabulary of {draft} of the target's {target} tokens, "
                         f"but {problem}: vLLM would read draft token i as the target's token i (its first "
                         f"{draft} ids), and nothing would say so. Nothing was exported.",
                         "train it with its vocabulary mapping (speculators' d2t/t2d: eyrie's train stage "
                         "makes one from the run's token frequencies, a base drafter brings its own), or "
                         "with a draft vocabulary of the target's size (`--draft-vocab "
                         f"{target}`), which needs none.")


def _mapping_problem(tensors: dict, draft: int, target: int) -> str | None:
    """What is wrong with a reduced vocabulary's d2t/t2d, or None."""
    missing = [name for name in ("d2t", "t2d") if name not in tensors]
    if missing:
        return f"its weights hold no {' or '.join(missing)} mapping"
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if tuple(d2t.shape) != (draft,) or tuple(t2d.shape) != (target,):
        return f"its mapping has the wrong shape (d2t {list(d2t.shape)}, t2d {list(t2d.shape)})"
    ids = torch.arange(draft) + d2t.long()  # speculators' convention: target id = draft id + d2t[draft id]
    if ids.min() < 0 or ids.max() >= target or ids.unique().numel() != draft:
        return "its d2t maps draft tokens outside the target's vocabulary or two onto one"
    if not torch.equal(t2d.bool().nonzero().flatten(), ids.sort().values):
        return "its t2d names other target tokens than its d2t"
    return None


def vllm_command(target: str, folder: str, k: int, flags: list[str] = ()) -> str:
    """The command that serves `target` with the drafter in `folder` at K = k, with the target's own serve
    `flags` (verify's, where it recorded them)."""
    served = " ".join(shlex.quote(flag) for flag in ["vllm", "serve", target, *flags])
    return f"{served} --speculative-config '{json.dumps(eagle3_spec(folder, k))}'"


def evaluate_and_export(store, run: str, eval_dir: Path, device: str, path: dict, log,
                        samples: dict | None = None) -> dict:
    evaluation = evaluate(store, run, eval_dir, device, log)
    record = export(store, run, evaluation, path, samples)
    return {"tau": record["tau"], "baseline_tau": record["baseline_tau"], "checkpoint": record["checkpoint"]}


def download(store, run: str, out: Path) -> dict:
    """`eyrie export`: the exported drafter from the store into `out`, checksums verified."""
    layout = Layout(run)
    try:
        record = store.get_json(layout.drafter_manifest)
    except KeyError:
        raise EyrieError(f"run {run} has no exported drafter yet.",
                         f"train it (`eyrie train --run {run} --wait`); the best checkpoint is exported at the end.") from None
    for name, entry in record["files"].items():
        store.get_file(entry["key"], entry["sha256"], out / name)
    return record
