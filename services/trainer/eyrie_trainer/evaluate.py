"""Simulated acceptance length tau of an EAGLE-3 drafter on stored hidden states.

Alignment (speculators' `shift_batch` + `Eagle3DraftModel.forward`): a sample has tokens
x[0..L-1] and hidden states g[0..L-1]. After the shift, position j (0 <= j < L-1) pairs token
x[j+1] with g[j], and TTT step k at position j predicts x[j+2+k]; steps k > 0 are fed the true
tokens, which is what inference sees while every earlier draft was accepted. So a draft that
starts at j (the target has just produced x[j+1]) is accepted for its first n steps when
draft[k, j] == x[j+2+k] for all k < n (greedy verification), and one verification step yields
1 + n tokens: tau = 1 + mean n. Starts count only where x[j+2] is an assistant token; a draft
stops at the end of the sequence and at the first non-assistant token.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

import torch

UNBOUNDED_LEN = 1 << 30  # ArrowDataset stores max_len; only its collate function truncates


def _acceptance(draft_target_ids: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor):
    """(accepted, horizon) per counted start: leading correct steps, and leading steps that
    have an assistant token to predict at all (the most a perfect drafter could get, <= K)."""
    k, n = draft_target_ids.shape
    length = input_ids.shape[0]
    if n != length - 1:
        raise ValueError(f"draft ids cover {n} positions, a {length}-token sample has {length - 1}")
    pos = torch.arange(n).unsqueeze(0) + 2 + torch.arange(k).unsqueeze(1)  # [K, L-1]: x index predicted
    inside = pos < length
    pos = pos.clamp(max=length - 1)
    assistant = loss_mask.to(torch.bool)[pos] & inside
    hit = (draft_target_ids.to(input_ids.device) == input_ids[pos]) & assistant
    accepted = hit.long().cumprod(0).sum(0)
    horizon = assistant.long().cumprod(0).sum(0)
    starts = assistant[0]
    return accepted[starts], horizon[starts]


def accepted_lengths(draft_target_ids: torch.Tensor, input_ids: torch.Tensor,
                     loss_mask: torch.Tensor) -> torch.Tensor:
    """Accepted draft tokens per start j (in order of j) whose first predicted token x[j+2]
    is an assistant token. draft_target_ids [K, L-1] holds TARGET-vocab ids, row k = step k
    (predicting x[j+2+k] at column j); input_ids and loss_mask are the unshifted [L] sample."""
    return _acceptance(draft_target_ids, input_ids, loss_mask)[0]


def to_target_ids(model, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocab ids to target ids: target = draft + d2t[draft] (speculators' offset
    convention); a drafter without a reduced vocabulary (d2t is None) predicts target ids."""
    d2t = getattr(model, "d2t", None)
    if d2t is None:
        return draft_ids
    return draft_ids + d2t.to(draft_ids.device)[draft_ids]


@contextmanager
def _dense_attention(model, impl: str = "sdpa"):
    """Flex attention needs sequences padded to its block size (speculators' collate pads to
    the total length); one unpadded sample needs a dense mask: sdpa, as the model builds it."""
    from speculators.models.attention import create_float_mask
    from torch.nn.attention.flex_attention import create_mask

    layer_config = model.config.transformer_layer_config
    saved = (layer_config._attn_implementation, model._attn_impl, model._create_mask_fn, model.training)
    layer_config._attn_implementation = model._attn_impl = impl
    model._create_mask_fn = create_float_mask if impl == "eager" else create_mask
    model.eval()
    try:
        yield
    finally:
        layer_config._attn_implementation, model._attn_impl, model._create_mask_fn, training = saved
        model.train(training)


def simulate(model, data_dir: Path, indices: list[int] | None = None, k: int = 3, device="cpu",
             transfer=None) -> dict:
    """tau of `model` (an Eagle3DraftModel) with k draft steps over the samples of a
    speculators-layout directory (all of them, or `indices`). `transfer`: a hs_connectors
    transfer for the stored files (FP8Transfer for fp8); default: plain files.

    Returns tau, k, samples, positions (counted starts), mean_accepted, histogram (starts
    with 0..k accepted tokens), step_acceptance (step s accepted among starts whose first s
    were accepted and that have a step s to predict; None where there are none)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    dataset = ArrowDataset(UNBOUNDED_LEN, str(data_dir), transfer=transfer, on_missing="raise",
                           hidden_states_dtype=torch.bfloat16)
    indices = list(range(len(dataset))) if indices is None else list(indices)
    device = torch.device(device)
    model.to(device)
    dtype = next(model.parameters()).dtype
    accepted, horizon = [], []
    with _dense_attention(model), torch.no_grad():
        for index in indices:
            sample = dataset[index]
            if isinstance(sample, SampleUnavailable):
                raise ValueError(f"sample {index} of {data_dir}: {sample.reason}")
            if sample["hidden_states"].element_size() == 1:  # plain files drop fp8's scales
                raise ValueError(f"{data_dir} holds fp8 hidden states: pass transfer=FP8Transfer(...)")
            if sample["input_ids"].shape[0] < 3:  # no start has a token to predict
                continue
            batch = shift_batch(sample)
            n = batch["input_ids"].shape[0]
            drafts = model(hidden_states=batch["hidden_states"].unsqueeze(0).to(device, dtype),
                           input_ids=batch["input_ids"].unsqueeze(0).to(device),
                           document_ids=torch.zeros(1, n, dtype=torch.long, device=device),
                           position_ids=batch["position_ids"].unsqueeze(0).to(device),
                           ttt_steps=k)
            target_ids = to_target_ids(model, torch.cat(drafts, dim=0)).cpu()
            got, most = _acceptance(target_ids, sample["input_ids"], sample["loss_mask"])
            accepted.append(got)
            horizon.append(most)
    return summarize(torch.cat(accepted or [torch.zeros(0, dtype=torch.long)]),
                     torch.cat(horizon or [torch.zeros(0, dtype=torch.long)]), k, len(indices))


def summarize(accepted: torch.Tensor, horizon: torch.Tensor, k: int, samples: int) -> dict:
    """The report of `simulate` from per-start accepted counts and horizons."""
    positions = int(accepted.numel())
    mean = float(accepted.double().mean()) if positions else 0.0
    steps = []
    for s in range(k):
        reached = int(((accepted >= s) & (horizon > s)).sum())
        steps.append(int((accepted > s).sum()) / reached if reached else None)
    return {"tau": 1.0 + mean, "k": k, "samples": samples, "positions": positions,
            "mean_accepted": mean, "histogram": torch.bincount(accepted, minlength=k + 1).tolist(),
            "step_acceptance": steps}


def untrained_like(model, seed: int = 0):
    """A freshly initialised drafter of the same config and vocabulary mapping, with the
    verifier's weights (embeddings, lm_head, final norm) loaded as speculators does for a new
    run: the baseline a trained drafter is compared with. When the verifier named in the
    config cannot be read here, its frozen weights are taken from `model` instead."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(model)(copy.deepcopy(model.config))
    fresh.load_vocab_mappings(model.t2d, model.d2t)
    try:
        verifier = model.config.speculators_config.verifier.name_or_path
        fresh.load_verifier_weights()
    except (OSError, ValueError):  # not on this machine, or a name the hub refuses
        verifier = None
    if verifier is None:
        for name in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
            getattr(fresh, name).load_state_dict(getattr(model, name).state_dict())
    parameter = next(model.parameters())
    return fresh.to(device=parameter.device, dtype=parameter.dtype)
