"""A run's hidden states from the store to a local directory in the layout speculators trains
from: a `save_to_disk` dataset (input_ids, loss_mask, seq_len), hidden_states/hs_<i>.safetensors
and token_freq.pt (loss-masked token counts, for the draft vocabulary).

Every object is checked against its sha256; files already in place are not fetched again, and
a directory whose marker names the same samples is not touched at all."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson

from eyrie.manifest import Layout, ShardManifest, load_run_manifest
from eyrie.store import sha256_file

MARKER = "eyrie-samples.json"


def done_samples(store, run: str) -> list[dict]:
    """Every extracted sample of the run, in shard and row order."""
    manifest, layout = load_run_manifest(store, run), Layout(run)
    samples = []
    for plan in manifest.generate_shards:
        shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(plan.index)))
        samples.extend(shard.samples)
    return samples


def heldout_ids(samples: list[dict], count: int) -> set[str]:
    """A fixed choice of held-out samples (never trained on): the lowest sample-id hashes."""
    ranked = sorted(samples, key=lambda s: hashlib.sha256(s["sample_id"].encode()).hexdigest())
    return {s["sample_id"] for s in ranked[:count]}


def materialize(store, run: str, dest: str | Path,
                select: Callable[[dict], bool] = lambda sample: True) -> int:
    """Returns the number of samples written. Sample i is the i-th selected sample."""
    dest = Path(dest)
    samples = [s for s in done_samples(store, run) if select(s)]
    fingerprint = [s["sha256"] for s in samples]
    marker = dest / MARKER
    if marker.exists() and orjson.loads(marker.read_bytes()) == fingerprint and _sizes_match(dest, samples):
        return len(samples)
    marker.unlink(missing_ok=True)
    _write(store, samples, dest)
    marker.write_bytes(orjson.dumps(fingerprint))
    return len(samples)


def prompt_token_ids(store, samples: list[dict], folder: Path) -> list[list[int]]:
    """Each sample's prompt token ids (those before its first answer token), read from its stored
    states file (fetched into `folder`, checked) without `datasets`: the verifier's image has none."""
    from safetensors import safe_open

    prompts = []
    for sample in samples:
        path = folder / f"{sample['sha256']}.safetensors"
        if not path.exists() or sha256_file(path) != sample["sha256"]:
            store.get_file(sample["key"], sample["sha256"], path)
        with safe_open(str(path), "pt") as tensors:
            prompts.append(tensors.get_tensor("token_ids")[: sample["prompt_len"]].tolist())
    return prompts


def _sizes_match(dest: Path, samples: list[dict]) -> bool:
    """A cheap check of a marked directory (a full re-hash of terabytes would not be): every file
    there, with its size. Anything else: every file is verified again and refetched if need be."""
    for index, sample in enumerate(samples):
        path = dest / "hidden_states" / f"hs_{index}.safetensors"
        if not path.exists() or path.stat().st_size != sample["bytes"]:
            return False
    return True


def _write(store, samples: list[dict], dest: Path) -> None:
    import datasets
    import torch
    from safetensors import safe_open

    (dest / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    for index, sample in enumerate(samples):
        path = dest / "hidden_states" / f"hs_{index}.safetensors"
        if not path.exists() or sha256_file(path) != sample["sha256"]:
            store.get_file(sample["key"], sample["sha256"], path)
        with safe_open(str(path), "pt") as tensors:  # the ids only, not the hidden states
            token_ids = tensors.get_tensor("token_ids").tolist()
        prompt_len, seq_len = sample["prompt_len"], sample["seq_len"]
        columns["input_ids"].append(token_ids)
        columns["loss_mask"].append([0] * prompt_len + [1] * (seq_len - prompt_len))
        columns["seq_len"].append(seq_len)
        freq.update(token_ids[prompt_len:])
    for stale in (dest / "hidden_states").glob("hs_*.safetensors"):
        if int(stale.stem.split("_")[1]) >= len(samples):
            stale.unlink()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")  # as speculators' prepare-data saves it
    dataset.save_to_disk(str(dest))
    torch.save(dict(freq), dest / "token_freq.pt")
