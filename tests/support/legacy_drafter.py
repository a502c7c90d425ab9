"""Tiny base drafters for the tiny target: a legacy EAGLE-3 checkpoint (SafeAILab / AQ-MedAI
layout) and a config-only speculators-format one, both deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _target(target: Path) -> dict:
    return json.loads((Path(target) / "config.json").read_text())


def legacy_weights(hidden: int, target_hidden: int, heads: int, kv_heads: int, inter: int,
                   target_vocab: int, draft_vocab: int, num_aux: int, seed: int) -> dict:
    """The names and shapes SafeAILab's EAGLE-3 checkpoints use: one `midlayer` whose attention
    reads [embeddings, hidden] (2 * hidden), `fc` fusing the aux states, and the vocab maps as
    stored there: d2t (int64, draft id -> target id minus draft id) and t2d (bool mask)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    head_dim = hidden // heads
    kept = torch.sort(torch.randperm(target_vocab, generator=gen)[:draft_vocab]).values
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[kept] = True
    weights = {
        "fc.weight": rand(hidden, num_aux * target_hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    return weights


def build_legacy_drafter(dest: Path, target: Path, hidden_size: int | None = None,
                         aux_layers: tuple[int, ...] | None = (2, 4, 5), draft_vocab: int = 500,
                         seed: int = 0) -> Path:
    """A legacy EAGLE-3 checkpoint for `target`. aux_layers go where AQ-MedAI's configs keep them
    (`eagle_config.eagle_aux_hidden_state_layer_ids`); None leaves them out (SafeAILab style).
    hidden_size overrides the drafter's width (a mismatching base, for refusal tests)."""
    t = _target(target)
    hidden = hidden_size or t["hidden_size"]
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": t["max_position_embeddings"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": 10000.0,
        "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"],
        "pad_token_id": t["pad_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": t["vocab_size"],
        "draft_vocab_size": draft_vocab,
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers),
                                  "use_aux_hidden_state": True}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    num_aux = len(aux_layers) if aux_layers is not None else 3
    weights = legacy_weights(hidden, hidden, heads, kv_heads, t["intermediate_size"],
                             t["vocab_size"], draft_vocab, num_aux, seed)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))
    return dest


def write_speculators_config(dest: Path, target: Path, *, hidden_size: int | None = None,
                             vocab_size: int | None = None, aux_layers: list[int] | None = None,
                             draft_vocab: int = 500) -> Path:
    """A config-only speculators-format EAGLE-3 base (what check_base reads), made by
    speculators' own config classes; each keyword overrides one field against the target."""
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    t = _target(target)
    hidden = hidden_size or t["hidden_size"]
    layer = LlamaConfig(vocab_size=vocab_size or t["vocab_size"], hidden_size=hidden,
                        intermediate_size=t["intermediate_size"], num_hidden_layers=1,
                        num_attention_heads=t["num_attention_heads"],
                        num_key_value_heads=t["num_key_value_heads"],
                        head_dim=hidden // t["num_attention_heads"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=t["architectures"])))
    config.save_pretrained(str(dest))
    return Path(dest)
