"""Which samples of an extract shard keep their hidden states in the bucket (extract.storage).

offline: every sample. online: none; each is stored as its token ids alone and training asks the
vLLM extraction service for its states. hybrid: the shard's samples in shard order while their
states files fit the shard's allowance (eyrie.core.storage.shard_allowance), the rest as ids alone.

The decision is a function of what the shard's stored records already say (an earlier attempt's
parts) and of the samples' lengths, walked in shard order with an upper bound of each states
file's size: a retry decides the rest exactly as the first attempt did, and the stored states
bytes never pass the allowance."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from safetensors.torch import save

from eyrie.core.budget import bytes_per_token
from eyrie.data.manifest import ExtractParams
from eyrie.work.extract_server import on_demand

HEADER_BOUND = 512  # a safetensors header of three tensors (fp8's states, scales and ids) fits in it


def states_file_bound(seq_len: int, params: ExtractParams) -> int:
    """The most bytes a sample's states file of `seq_len` tokens takes (eyrie.core.budget's per-token size)."""
    per_token = bytes_per_token(len(params.aux_layers) + 1, params.hidden_size, params.dtype)
    return int(seq_len * per_token) + HEADER_BOUND


def split(params: ExtractParams, stored: Iterable[dict], todo: list[dict]) -> tuple[list[dict], list[dict]]:
    """`todo` (rendered samples, each with `row` and `input_ids`) as (with states, token ids alone);
    `stored`: the shard's records so far, whatever their status."""
    if params.storage == "offline":
        return todo, []
    if params.storage == "online":
        return [], todo
    keeps = _hybrid_keeps(params, stored, todo)
    return [s for s in todo if keeps[s["sample_id"]]], [s for s in todo if not keeps[s["sample_id"]]]


def _hybrid_keeps(params: ExtractParams, stored: Iterable[dict], todo: list[dict]) -> dict[str, bool]:
    """For each sample of `todo` (by id), whether it keeps its states: the shard's samples in row
    order keep them while the running bound stays within the allowance; a stored record keeps the
    decision it was stored with."""
    decided = {r["row"]: (r["seq_len"], not on_demand(r)) for r in stored if r["status"] == "done"}
    pending = {s["row"]: s for s in todo}
    used, filling, keeps = 0, True, {}
    for row in sorted(decided.keys() | pending.keys()):
        if row in decided:
            seq_len, keep = decided[row]
        else:
            seq_len = len(pending[row]["input_ids"])
            keep = filling and used + states_file_bound(seq_len, params) <= params.shard_allowance_bytes
            keeps[pending[row]["sample_id"]] = keep
        filling = filling and keep
        used += states_file_bound(seq_len, params) if keep else 0
    return keeps


def ids_file(input_ids: list[int]) -> bytes:
    """The object of a sample whose states training asks the extraction service for: `token_ids` alone."""
    return save({"token_ids": torch.tensor(input_ids, dtype=torch.long)})
