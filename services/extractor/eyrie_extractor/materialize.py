"""A run's hidden states from the store to a local directory in the layout speculators trains
from: a `save_to_disk` dataset (input_ids, loss_mask, seq_len) and hidden_states/hs_<i>.safetensors.
Every object is checked against its sha256; files already in place are not fetched again."""

from __future__ import annotations

import hashlib
from pathlib import Path

from eyrie.manifest import Layout, ShardManifest, load_run_manifest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def materialize(store, run: str, dest: str | Path) -> int:
    """Returns the number of samples. Sample i is the i-th done sample in shard and row order."""
    import datasets
    from safetensors.torch import load_file

    dest, layout = Path(dest), Layout(run)
    manifest = load_run_manifest(store, run)
    (dest / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    index = 0
    for plan in manifest.generate_shards:
        shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(plan.index)))
        for sample in shard.samples:
            path = dest / "hidden_states" / f"hs_{index}.safetensors"
            if not path.exists() or _sha256_file(path) != sample["sha256"]:
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(store.get_verified(sample["key"], sample["sha256"]))
                tmp.replace(path)
            token_ids = load_file(path)["token_ids"].tolist()
            prompt_len, seq_len = sample["prompt_len"], sample["seq_len"]
            columns["input_ids"].append(token_ids)
            columns["loss_mask"].append([0] * prompt_len + [1] * (seq_len - prompt_len))
            columns["seq_len"].append(seq_len)
            index += 1
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")  # as speculators' prepare-data saves it
    dataset.save_to_disk(str(dest))
    return index
