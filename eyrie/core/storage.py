"""Where training's hidden states live (extract.storage): offline, hybrid or online, auto's choice
of the two that store, and a hybrid shard's allowance (their costs, for --plan: eyrie.runs.storage_plan)."""

from __future__ import annotations

from eyrie.core.errors import EyrieError

MODES = ("offline", "hybrid", "online")  # least extraction first: one pass, part of one per epoch, one per epoch
ON_DEMAND = ("hybrid", "online")  # training asks the vLLM extraction service for the states not stored


def trains_on_demand(manifest) -> bool:
    """A run (its manifest, extract.storage resolved) whose training asks the extraction service."""
    return manifest.extract is not None and manifest.extract.storage in ON_DEMAND


def resolve_mode(asked: str, need_bytes: int, budget_bytes: int | None) -> str:
    """The mode a run's extract stage uses: `auto` is offline where every hidden state fits the
    budget (or none is set), else hybrid (the bucket holds what the budget allows)."""
    if asked != "auto":
        return asked
    return "offline" if budget_bytes is None or need_bytes <= budget_bytes else "hybrid"


def shard_allowance(mode: str, budget_bytes: int | None, shards: int) -> int | None:
    """hybrid: the bytes one shard may store, its states files and ids-only objects alike (as the
    plan's bucket counts them), the budget spread evenly over the shards (no shard needs to know
    another's bytes, so retries and parallel workers keep the bound)."""
    if mode != "hybrid":
        return None
    if budget_bytes is None:
        raise EyrieError("extract.storage: hybrid stores hidden states up to extract.budget, and none is set.",
                         "set extract.budget (e.g. 2.8TB), or extract.storage: offline or online.")
    return budget_bytes // max(1, shards)
