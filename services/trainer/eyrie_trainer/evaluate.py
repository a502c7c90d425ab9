"""Simulated acceptance length tau of an EAGLE-3 drafter on stored hidden states.

Alignment (speculators' `shift_batch` + `Eagle3DraftModel.forward`): a sample has tokens
x[0..L-1] and hidden states g[0..L-1]. After the shift, position j (0 <= j < L-1) pairs token
x[j+1] with g[j], and TTT step k at position j predicts x[j+2+k]; steps k > 0 are fed the true
tokens, which is what inference sees while every earlier draft was accepted. So a draft that
starts at j (the target has just produced x[j+1]) is accepted for its first n steps when
draft[k, j] == x[j+2+k] for all k < n (greedy verification), and one verification step yields
1 + n tokens.

`tau` (the mean acceptance length) is measured as vLLM measures it (`walk`): each held-out
answer is decoded as the server would, from its first token (the prefill's): draft K tokens at
the current position, accept while each draft equals the TARGET'S GREEDY token (the argmax of the
target's final norm and lm_head applied to the stored last, pre-norm, hidden state), advance by
accepted + 1; tau = 1 + accepted drafts / verification steps, and the per-position rate is the
share of steps whose first p + 1 drafts were accepted (vLLM's `/metrics` counters). Like vLLM, a
draft past the end token is still compared with the target's prediction there, as far as the
stored states reach (one token past the end; vLLM may accept a few more, which shows as its
figure running slightly above ours).

`every_position` keeps the older, teacher-forced statistic: a draft started at EVERY answer
position, compared with the stored tokens, stopping at the sequence end; it weighs positions, not
verification steps, so it is not what a server sees.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from eyrie.core.errors import EyrieError
from eyrie_trainer.engine import native_bf16

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
             transfer=None, target: str | None = None, greedy: list[torch.Tensor] | None = None) -> dict:
    """tau of `model` (an Eagle3DraftModel) with k draft steps over the samples of a
    speculators-layout directory (all of them, or `indices`). `transfer`: a hs_connectors
    transfer for the stored files (FP8Transfer for fp8); default: plain files. `target`: where
    the target's weights are (default: the drafter's verifier).

    Returns tau (= acceptance_length, see `walk`), per_position_acceptance, drafts (verification
    steps), accepted_tokens, k, samples, greedy_from, and every_position: the teacher-forced
    statistic (tau, positions: counted starts, mean_accepted, histogram: starts with 0..k
    accepted, step_acceptance: step s accepted among starts whose first s were). `greedy`: the
    target's greedy tokens per sample of `data_dir` (`target_greedy`: computed once for every
    checkpoint), else computed here."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    dataset = ArrowDataset(UNBOUNDED_LEN, str(data_dir), transfer=transfer, on_missing="raise",
                           hidden_states_dtype=torch.bfloat16)
    indices = list(range(len(dataset))) if indices is None else list(indices)
    device = torch.device(device)
    model.to(device)
    dtype = next(model.parameters()).dtype
    accepted, horizon, steps = [], [], []
    head = TargetHead(model, target) if greedy is None else None
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
            chosen = greedy[index] if head is None else head.greedy(sample["verifier_last_hidden_states"])
            steps += walk(target_ids, chosen, sample["loss_mask"], k)
    report = summarize_walk(steps, k, len(indices))
    report["greedy_from"] = head.source if head else f"target lm_head ({target or _verifier(model)})"
    report["every_position"] = summarize(torch.cat(accepted or [torch.zeros(0, dtype=torch.long)]),
                                         torch.cat(horizon or [torch.zeros(0, dtype=torch.long)]), k)
    return report


def walk(drafts: torch.Tensor, greedy: torch.Tensor, loss_mask: torch.Tensor, k: int) -> list[int]:
    """Accepted drafts per verification step, decoding each answer as a server would (a conversation's
    answers one after another; the user turns between them are prefill, never drafted).
    drafts [K, L-1] (target ids; column j: drafted after x[j+1] was produced, row s predicting
    x[j+2+s]); greedy [L]: the target's greedy token after each position (greedy[p] follows x[p])."""
    steps = []
    for start, end in answer_spans(loss_mask):
        j = start - 1  # the prefill produced x[start]: the first draft follows it
        while j <= end - 3:  # x[j+1] is not the answer's last token: the server verifies another draft
            n = 0
            while n < k and j + 1 + n < end and int(drafts[n, j]) == int(greedy[j + 1 + n]):
                n += 1
            steps.append(n)
            j += n + 1
    return steps


def answer_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised positions: the answers of a sample."""
    mask = loss_mask.to(torch.bool).tolist()
    edges = [i for i in range(len(mask) + 1)
             if (i < len(mask) and mask[i]) != (i > 0 and mask[i - 1])]
    return list(zip(edges[::2], edges[1::2]))


def summarize_walk(steps: list[int], k: int, samples: int) -> dict:
    """vLLM's figures from accepted drafts per step: mean acceptance length and per position."""
    drafts = len(steps)
    accepted = torch.tensor(steps, dtype=torch.long)
    per_position = [int((accepted > p).sum()) / drafts if drafts else None for p in range(k)]
    length = 1.0 + float(accepted.double().mean()) if drafts else 1.0
    return {"tau": length, "acceptance_length": length, "per_position_acceptance": per_position,
            "drafts": drafts, "accepted_tokens": int(accepted.sum()), "k": k, "samples": samples}


def _verifier(model) -> str:
    return model.config.speculators_config.verifier.name_or_path


def target_greedy(data_dir: Path, target: str, device: str = "cpu", transfer=None) -> list[torch.Tensor]:
    """The target's greedy token after every position of every sample in `data_dir`, computed once
    (not again per checkpoint) on `device`, and kept beside the samples (greedy.safetensors, for
    these very samples and this target) for a retried task and `eyrie evaluate`."""
    from safetensors.torch import load_file, save_file
    from speculators.train.data import ArrowDataset

    cache, key = data_dir / "greedy.safetensors", _greedy_key(data_dir, target)
    if cache.exists() and _stored_key(cache) == key:
        stored = load_file(str(cache))
        return [stored[f"sample_{i}"] for i in range(len(stored))]
    dataset = ArrowDataset(UNBOUNDED_LEN, str(data_dir), transfer=transfer, on_missing="raise",
                           hidden_states_dtype=torch.bfloat16)
    head = TargetHead(None, target, device)
    greedy = [head.greedy(dataset[i]["verifier_last_hidden_states"]) for i in range(len(dataset))]
    save_file({f"sample_{i}": g.contiguous() for i, g in enumerate(greedy)}, str(cache), metadata={"key": key})
    return greedy


def _greedy_key(data_dir: Path, target: str) -> str:
    """The samples (eyrie_trainer.data's marker of the directory) and the target they are for."""
    import hashlib

    marker = data_dir / "eyrie-samples.json"
    samples = marker.read_bytes() if marker.exists() else str(sorted(p.stat().st_size for p in
                                                                     (data_dir / "hidden_states").glob("*"))).encode()
    return hashlib.sha256(samples + target.encode()).hexdigest()


def _stored_key(cache: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(cache), "pt") as stored:
        return (stored.metadata() or {}).get("key")


class TargetHead:
    """The target's final norm and lm_head: its greedy token from a stored last (pre-norm) hidden
    state, read from the target's safetensors: a directory, or a hub id's files already in this
    host's Hugging Face cache (never downloaded here). Where neither is readable, refused: the
    drafter's frozen copies cover the draft vocabulary only and would miss greedy tokens outside it."""

    def __init__(self, model, target: str | None, device: str = "cpu"):
        target = target or _verifier(model)
        folder = local_files(target)
        self.device = torch.device(device)
        try:
            self._read(folder)
        except (OSError, KeyError, ValueError) as exc:
            raise EyrieError(f"eyrie's acceptance length needs the target's final norm and lm_head: none "
                             f"readable in {folder} ({exc}).",
                             f"put the target's config.json and *.safetensors there, or fetch {target} into this "
                             "host's Hugging Face cache (`hf download TARGET --include '*.json' '*.safetensors'`).") from None
        self.source = f"target lm_head ({target})"

    def _read(self, folder: Path) -> None:
        from safetensors import safe_open

        config = _text_config(folder)
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as weights:
                for name in weights.keys():
                    if name.endswith(("lm_head.weight", "embed_tokens.weight")) or (
                            name.endswith("norm.weight") and ".layers." not in name):
                        found[name.rsplit(".", 2)[-2]] = weights.get_tensor(name)
        head = found.get("lm_head")
        if head is None and config.get("tie_word_embeddings", False):
            head = found.get("embed_tokens")
        if head is None or "norm" not in found:
            raise KeyError(f"no final norm / lm_head in {folder}")
        self.dtype = self._dtype(head.dtype)
        self.norm_weight, self.lm_head = (t.to(self.device, self.dtype) for t in (found["norm"], head))
        self.eps = config["rms_norm_eps"]

    def _dtype(self, stored: torch.dtype) -> torch.dtype:
        """The target's own dtype (its stored weights'), as the server computes its greedy token, where
        the device computes it natively; fp32 elsewhere (bf16 is emulated on an AVX2 CPU, ~60x slower)."""
        native = self.device.type == "cuda" or (stored == torch.bfloat16 and native_bf16("cpu"))
        return stored if native else torch.float32

    def greedy(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """As HF's RMSNorm and lm_head compute it: normalized in fp32, then in the head's dtype."""
        with torch.no_grad():
            h = last_hidden.to(self.device, torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            h = self.norm_weight * h.to(self.dtype)
            return (h @ self.lm_head.T).argmax(-1).cpu()


def _text_config(folder: Path) -> dict:
    """config.json's text model settings, read as data: a target whose architecture needs its own code
    (trust_remote_code) is read without running that code; a multimodal one's text_config wins."""
    raw = json.loads((folder / "config.json").read_text())
    return {**raw, **(raw.get("text_config") or {})}


def local_files(target: str) -> Path:
    """The target's directory: as given, or a hub id's snapshot in the local Hugging Face cache."""
    if Path(target).is_dir():
        return Path(target)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(target, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise EyrieError(f"eyrie's acceptance length needs the target's final norm and lm_head, and {target} is "
                         "neither a directory on this host nor in its Hugging Face cache.",
                         f"fetch it here first (`hf download {target} --include '*.json' '*.safetensors'`, "
                         "HF_HOME as the trainer's), or set target.model to a local directory.") from None


def summarize(accepted: torch.Tensor, horizon: torch.Tensor, k: int) -> dict:
    """The teacher-forced every-position statistic from per-start accepted counts and horizons."""
    positions = int(accepted.numel())
    mean = float(accepted.double().mean()) if positions else 0.0
    steps = []
    for s in range(k):
        reached = int(((accepted >= s) & (horizon > s)).sum())
        steps.append(int((accepted > s).sum()) / reached if reached else None)
    return {"tau": 1.0 + mean, "positions": positions,
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
