"""Hidden states from a HuggingFace transformers forward pass (CPU or GPU).

Per sample: `[seq, n_aux + 1, H]`, the aux layers' inputs and the last decoder layer's output
BEFORE the final norm (speculators applies the verifier's norm and lm_head itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from eyrie.core.target import hf_load


@dataclass
class Batch:
    samples: list  # whatever the caller needs back, one per sequence
    input_ids: list[list[int]]


def token_budget_batches(items: list, lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that each batch's padded size stays within max_tokens."""
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


def spread_devices(model_path: str, device: str) -> list[str]:
    """`cuda:0,cuda:1,...`: those devices; `cuda` (every GPU the lease grants this process) with
    several GPUs: all of them when the weights do not fit on one, else the first; else `device`."""
    if "," in device:
        return [d.strip() for d in device.split(",") if d.strip()]
    if device != "cuda" or torch.cuda.device_count() < 2:
        return [device]
    weights = weight_bytes(model_path)
    if weights is not None and weights < 0.8 * torch.cuda.get_device_properties(0).total_memory:
        return ["cuda:0"]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def weight_bytes(model_path: str) -> int | None:
    from pathlib import Path

    files = list(Path(model_path).glob("*.safetensors")) + list(Path(model_path).glob("*.bin"))
    return sum(f.stat().st_size for f in files) if files else None


def spread_map(config, devices: list[str]) -> dict[str, str]:
    """A device map of whole modules: the decoder layers in contiguous, even blocks over the
    devices; what runs before them (embeddings) on the first, the rest (norm, rotary, head) on
    the last. Built on a weightless skeleton (accelerate's meta device)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    prefix = skeleton.base_model_prefix
    base = getattr(skeleton, prefix)
    layers, block = len(base.layers), -(-len(base.layers) // len(devices))
    mapping, before = {}, True
    for name, _ in base.named_children():
        if name == "layers":
            before = False
            mapping.update({f"{prefix}.layers.{i}": devices[i // block] for i in range(layers)})
        else:
            mapping[f"{prefix}.{name}"] = devices[0] if before else devices[-1]
    for name, _ in skeleton.named_children():
        if name != prefix:
            mapping[name] = devices[-1]
    return mapping


class HFCapture:
    """Loads the target once; `forward` returns per-sequence hidden states on the host."""

    def __init__(self, model_path: str, aux_layers: list[int], device: str, dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        devices = spread_devices(model_path, device)
        self.device = torch.device(devices[0])
        if len(devices) == 1:
            self.model = hf_load(partial(AutoModelForCausalLM.from_pretrained, dtype=dtype or "auto"),
                                 model_path, "model", trust_remote_code).to(self.device)
        else:  # a target larger than one GPU: whole layers spread over the lease's devices
            self.device_map = spread_map(hf_load(AutoConfig.from_pretrained, model_path, "config", trust_remote_code),
                                         devices)
            self.model = hf_load(partial(AutoModelForCausalLM.from_pretrained, dtype=dtype or "auto",
                                         device_map=self.device_map), model_path, "model", trust_remote_code)
        self.model.eval()
        self.aux_layers = aux_layers
        self.decoder_layers = self._decoder_layers()
        self.num_layers = len(self.decoder_layers)
        self.hidden_size = self.model.config.get_text_config().hidden_size
        self._captured: dict[int, torch.Tensor] = {}
        self._register_hooks()

    def _decoder_layers(self):
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        return base.layers

    def _register_hooks(self) -> None:
        """Layer id i = the input of decoder layer i; num_layers = the last layer's output."""
        def keep(layer_id):
            def hook(_module, args, kwargs, output=None):
                tensor = output if output is not None else (args[0] if args else kwargs["hidden_states"])
                self._captured[layer_id] = tensor[0] if isinstance(tensor, tuple) else tensor
            return hook

        for layer_id in set(self.aux_layers):
            if layer_id < self.num_layers:
                self.decoder_layers[layer_id].register_forward_pre_hook(
                    lambda m, a, k, i=layer_id: keep(i)(m, a, k), with_kwargs=True)
        last = self.num_layers
        self.decoder_layers[-1].register_forward_hook(
            lambda m, a, k, out, i=last: keep(i)(m, a, k, out), with_kwargs=True)

    @torch.inference_mode()
    def forward(self, input_ids: list[list[int]]) -> torch.Tensor:
        """Right-padded batch -> `[batch, max_len, n_aux + 1, H]` on the device (padding rows
        are garbage; the caller slices each sequence to its length)."""
        longest = max(len(ids) for ids in input_ids)
        ids = torch.zeros(len(input_ids), longest, dtype=torch.long)
        mask = torch.zeros(len(input_ids), longest, dtype=torch.long)
        for row, seq in enumerate(input_ids):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        self._captured.clear()
        # The lm_head is not needed: run the base model only (saves the vocab projection).
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        layers = [self._captured[i] for i in self.aux_layers] + [self._captured[self.num_layers]]
        return torch.stack([t.to(self.device) for t in layers], dim=2)  # spread: layers on several devices
