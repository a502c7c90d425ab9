"""A run's hidden states from the store to a local directory in the layout speculators trains
from: a `save_to_disk` dataset (input_ids, loss_mask, seq_len), hidden_states/hs_<i>.safetensors
and token_freq.pt (loss-masked token counts, for the draft vocabulary).

A sample stored as its token ids alone (extract.storage hybrid or online) is a row of the dataset
with no hs_<i> file: speculators asks the vLLM extraction service for its states when it loads it.
The held-out set's such samples get theirs from the service once (`fetch_heldout_states`, for the
train task and `eyrie evaluate`): their evaluation reads states files.

Every object is checked against its sha256; files already in place are not fetched again, and
a directory whose marker names the same samples is not touched at all."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson

from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Layout, ShardManifest, load_run_manifest
from eyrie.data.store import sha256_file
from eyrie.work.extract_server import api_base, on_demand, server_url

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


def materialize(store, run: str, dest: str | Path, select: Callable[[dict], bool] = lambda sample: True,
                validation: Callable[[dict], bool] = lambda sample: False, linked_from: Path | None = None) -> int:
    """Returns the number of selected samples written: sample i is the i-th selected sample. The
    `validation` ones follow them (rows n, n+1, ...: speculators' validation split, see
    `split_ratio`), their files hard-linked from `linked_from` (their own materialized directory,
    in the same order) where they are there, so nothing is stored twice; the token frequencies
    (the draft vocabulary) count the selected samples only."""
    dest = Path(dest)
    everything = done_samples(store, run)
    samples = [s for s in everything if select(s)]
    tail = [s for s in everything if validation(s)]
    fingerprint = [s["sha256"] for s in samples] + ([{"validation": [s["sha256"] for s in tail]}] if tail else [])
    marker = dest / MARKER
    if marker.exists() and orjson.loads(marker.read_bytes()) == fingerprint \
            and _sizes_match(dest, samples + tail):
        return len(samples)
    marker.unlink(missing_ok=True)
    _write(store, samples, dest, tail, linked_from)
    marker.write_bytes(orjson.dumps(fingerprint))
    return len(samples)


def split_ratio(train_rows: int, validation_rows: int) -> float:
    """speculators' train_data_ratio that makes its training split exactly the first `train_rows`
    rows (its split is int(rows * ratio), and it takes neither 1.0 nor an empty validation split)."""
    return (train_rows + 0.5) / (train_rows + validation_rows)


def prompt_token_ids(store, samples: list[dict], folder: Path) -> list[list[int]]:
    """Each sample's prompt token ids (those before its first answer token), read from its stored
    object (its states file, or its ids alone; fetched into `folder`, checked) without `datasets`:
    the verifier's image has none."""
    from safetensors import safe_open

    prompts = []
    for sample in samples:
        path = folder / f"{sample['sha256']}.safetensors"
        if not path.exists() or sha256_file(path) != sample["sha256"]:
            store.get_file(sample["key"], sample["sha256"], path)
        with safe_open(str(path), "pt") as tensors:
            prompts.append(tensors.get_tensor("token_ids")[: sample["prompt_len"]].tolist())
    return prompts


def states_path(dest: Path, index: int) -> Path:
    """Where speculators looks for sample `index`'s states (hs_connectors' FileTransfer)."""
    return dest / "hidden_states" / f"hs_{index}.safetensors"


def _sizes_match(dest: Path, samples: list[dict]) -> bool:
    """A cheap check of a marked directory (a full re-hash of terabytes would not be): every stored
    states file there, with its size. Anything else: every file is verified again and refetched
    if need be. An on-demand sample's file, if any, was fetched from the service and checked then."""
    for index, sample in enumerate(samples):
        path = states_path(dest, index)
        if not on_demand(sample) and (not path.exists() or path.stat().st_size != sample["bytes"]):
            return False
    return True


def _write(store, samples: list[dict], dest: Path, tail: list[dict] = (), linked_from: Path | None = None) -> None:
    import datasets
    import torch

    (dest / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    for index, sample in enumerate([*samples, *tail]):
        path = states_path(dest, index)
        if index >= len(samples) and linked_from is not None:
            _link(states_path(linked_from, index - len(samples)), path)
        token_ids = _on_demand_ids(store, sample, path) if on_demand(sample) else _stored_ids(store, sample, path)
        seq_len = sample["seq_len"]
        mask = sample_loss_mask(sample)
        columns["input_ids"].append(token_ids)
        columns["loss_mask"].append(mask)
        columns["seq_len"].append(seq_len)
        if index < len(samples):
            freq.update(t for t, supervised in zip(token_ids, mask) if supervised)
    for stale in (dest / "hidden_states").glob("hs_*.safetensors"):
        if int(stale.stem.split("_")[1]) >= len(samples) + len(tail):
            stale.unlink()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")  # as speculators' prepare-data saves it
    dataset.save_to_disk(str(dest))
    torch.save(dict(freq), dest / "token_freq.pt")


def sample_loss_mask(sample: dict) -> list[int]:
    """1 over every assistant answer of the sample (its `spans`; one answer: all after the prompt)."""
    spans = sample.get("spans") or [[sample["prompt_len"], sample["seq_len"]]]
    mask = [0] * sample["seq_len"]
    for start, end in spans:
        mask[start:end] = [1] * (min(end, sample["seq_len"]) - start)
    return mask


def _link(source: Path, path: Path) -> None:
    """`path` as a hard link to `source` (the same file, not a copy), where `source` is there and
    `path` is not already that file; the sample's checks after it decide whether it is kept."""
    if not source.exists() or (path.exists() and path.samefile(source)):
        return
    path.unlink(missing_ok=True)
    try:
        os.link(source, path)
    except OSError:  # another filesystem: the store is asked instead
        pass


def _stored_ids(store, sample: dict, path: Path) -> list[int]:
    """A sample with stored states: its file in place (fetched unless already there, checked), its ids."""
    from safetensors import safe_open

    if not path.exists() or sha256_file(path) != sample["sha256"]:
        store.get_file(sample["key"], sample["sha256"], path)
    with safe_open(str(path), "pt") as tensors:  # the ids only, not the hidden states
        return tensors.get_tensor("token_ids").tolist()


def _on_demand_ids(store, sample: dict, path: Path) -> list[int]:
    """An on-demand sample: its ids from its stored object. A file in its place stays only where it
    holds states for these very ids (fetched from the service before); else speculators would read
    it instead of asking the service."""
    from safetensors import safe_open
    from safetensors.torch import load

    token_ids = load(store.get_verified(sample["key"], sample["sha256"]))["token_ids"].tolist()
    if path.exists():
        with safe_open(str(path), "pt") as tensors:
            current = "hidden_states" in tensors.keys() and tensors.get_tensor("token_ids").tolist() == token_ids
        if not current:
            path.unlink()
    return token_ids


def missing_states(dest: Path) -> list[int]:
    """The rows of a materialized directory with no states file (on-demand samples)."""
    import datasets

    rows = len(datasets.load_from_disk(str(dest)))
    return [index for index in range(rows) if not states_path(dest, index).exists()]


def fetch_heldout_states(settings, conn, manifest, eval_dir: Path, max_retries: int,
                         waiting: Callable[[str], None], cancelled: Callable[[], bool],
                         on_ready: Callable[[], None] = lambda: None) -> tuple[str, int]:
    """The extraction service waited for (EYRIE_EXTRACT_VLLM_URL, else the one `eyrie serve-extract`
    published: eyrie.work.extract_server), then every row of `eval_dir` without a states file gets
    one from it, once: evaluation reads files. Returns the service's API root and how many were fetched."""
    endpoint = api_base(server_url(settings, conn, waiting, cancelled))
    on_ready()
    fetched = fetch_missing_states(eval_dir, endpoint, manifest.target.model, manifest.generate.request_timeout_s,
                                   max_retries)
    return endpoint, fetched


def fetch_missing_states(dest: Path, endpoint: str, model: str, timeout_s: float, max_retries: int) -> int:
    """Every row of `dest` without a states file gets one from the extraction service at `endpoint`
    (its OpenAI API root), as speculators' training would ask it (its request, its file transfer,
    its check), saved as bf16 like a stored sample's. Returns how many were fetched."""
    import datasets
    from hs_connectors.transfer import FileTransfer
    from openai import OpenAI

    missing = missing_states(dest)
    if not missing:
        return 0
    rows = datasets.load_from_disk(str(dest)).with_format(None)
    client, transfer = OpenAI(base_url=endpoint, api_key="EMPTY", max_retries=0), FileTransfer(dest / "hidden_states")
    for index in missing:
        states = _generated_states(client, transfer, model, rows[index]["input_ids"], timeout_s, max_retries)
        _save_states(states, states_path(dest, index))
    return len(missing)


def _generated_states(client, transfer, model: str, input_ids: list[int], timeout_s: float, max_retries: int) -> dict:
    """One sample's states from the service: speculators' generate_hidden_states, its file read by
    hs_connectors' FileTransfer and checked by speculators (token ids, length, finite), then deleted."""
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states

    handle, params = generate_hidden_states(client, model, {"input_ids": input_ids}, timeout=timeout_s,
                                            max_retries=max_retries)
    try:
        states = transfer.get_generated(params)
        if states is None:
            raise EyrieError(f"the vLLM extraction service wrote {handle}, which this host cannot read.",
                             "mount the extraction server's shared directory here at the same path "
                             "(EYRIE_EXTRACT_SHARED_DIR; docker-compose.yml's extract-hs volume).")
        check_hidden_states(states, input_ids)
        return states
    finally:
        with contextlib.suppress(FileNotFoundError):  # the service's file: read or not, never kept there
            transfer.delete(handle)


def _save_states(states: dict, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.part")
    save_file({"hidden_states": states["hidden_states"].to(torch.bfloat16).contiguous(),
               "token_ids": states["token_ids"].to(torch.long).contiguous()}, str(tmp))
    tmp.replace(path)
