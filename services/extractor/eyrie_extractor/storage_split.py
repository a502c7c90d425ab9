"""Which samples of an extract shard keep their hidden states in the bucket (extract.storage).

offline: every sample. online: none; each is stored as its token ids alone and training asks the
vLLM extraction service for its states. hybrid: the shard's objects, states files and ids-only
objects alike, fit the shard's allowance (eyrie.core.storage.shard_allowance), as the plan's bucket
fits the budget (eyrie.runs.storage_plan): every sample's ids-only object is counted first, then in
shard order a sample's states file takes its place while the shard's total stays within the allowance.

The decision is a function of what the shard's stored records already say (an earlier attempt's
parts) and of the samples' lengths, walked in shard order with an upper bound of each object's
size: a retry decides the rest exactly as the first attempt did, and the shard's stored bytes never
pass the allowance (where its token ids alone fit it: the plan refuses hybrid where they do not)."""

from __future__ import annotations

from collections.abc import Iterable

from eyrie.core.budget import bytes_per_token, token_id_bytes
from eyrie.data.manifest import ExtractParams
from eyrie.work.extract_server import on_demand

HEADER_BOUND = 512  # a safetensors header of three tensors (fp8's states, scales and ids) fits in it


def states_file_bound(seq_len: int, params: ExtractParams) -> int:
    """The most bytes a sample's states file of `seq_len` tokens takes (eyrie.core.budget's per-token size)."""
    per_token = bytes_per_token(len(params.aux_layers) + 1, params.hidden_size, params.dtype)
    return int(seq_len * per_token) + HEADER_BOUND


def ids_object_bound(seq_len: int) -> int:
    """The most bytes a sample's ids-only object takes: the plan's figure for it (its one-tensor
    header is under 100 B, the plan's file overhead 256 B)."""
    return token_id_bytes(seq_len, 1)


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
    """For each sample of `todo` (by id), whether it keeps its states: starting from every sample's
    ids-only bound, the shard's samples in row order swap it for their states file's bound while
    the total stays within the allowance; a stored record keeps the decision it was stored with."""
    decided = {r["row"]: not on_demand(r) for r in stored if r["status"] == "done"}
    lengths = {r["row"]: r["seq_len"] for r in stored if r["status"] == "done"}
    lengths.update({s["row"]: len(s["input_ids"]) for s in todo})
    ids = {s["row"]: s["sample_id"] for s in todo}
    used = sum(ids_object_bound(n) for n in lengths.values())
    filling, keeps = True, {}
    for row in sorted(lengths):
        extra = states_file_bound(lengths[row], params) - ids_object_bound(lengths[row])
        keep = decided[row] if row in decided else filling and used + extra <= params.shard_allowance_bytes
        if row in ids:
            keeps[ids[row]] = keep
        filling = filling and keep
        used += extra if keep else 0
    return keeps
