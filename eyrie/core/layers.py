"""Which hidden states EAGLE-3 learns from: aux layer ids, checked against the model."""

from __future__ import annotations

from eyrie.core.errors import EyrieError


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's rule, as vLLM and speculators apply it."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """Layer id i is the input of decoder layer i (0: the embeddings; num_layers: the last
    layer's output), as in vLLM's eagle_aux_hidden_state_layer_ids."""
    layers = requested if requested is not None else default_aux_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad or len(set(layers)) != len(layers) or not layers:
        why = f"out of range [0, {num_layers}]: {bad}" if bad else "not distinct" if layers else "empty"
        fix = (f"pass --layers with distinct ids in [0, {num_layers}], e.g. "
               f"--layers {','.join(map(str, _spread(num_layers)))}")
        raise EyrieError(f"aux layers {layers} for a {num_layers}-layer target are {why}.", fix)
    return sorted(layers)  # vLLM feeds a drafter its aux states in ascending layer order


def _spread(n: int) -> list[int]:
    return sorted({max(0, min(n, i)) for i in (1, n // 2, n - 1)}) if n >= 3 else list(range(n + 1))
