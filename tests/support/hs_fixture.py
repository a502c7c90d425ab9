"""A small speculators-layout hidden-states directory built straight from the tiny target, without
servers: greedy answers from `model.generate`, hidden states from the extractor's HFCapture,
files from its `sample_tensors`, the dataset as `eyrie materialize` writes it."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import torch

from tests.support.harness import ROOT

TINY = ROOT / "assets" / "tiny-target"
PROMPTS = ROOT / "tests" / "data" / "tiny_prompts.jsonl"
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _chats(n: int, seed: int) -> list[list[dict]]:
    """The rows of tiny_prompts.jsonl, then (for n > 40) other prompts of the tiny corpus
    (scripts/build_tiny_target.py), in an order drawn with `seed`."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    chats = [[{"role": ROLES[t["from"]], "content": t["value"]} for t in r["conversations"]] for r in rows]
    if n > len(chats):
        spec = importlib.util.spec_from_file_location("build_tiny_target", ROOT / "scripts" / "build_tiny_target.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        seen = {c[-1]["content"] for c in chats}
        extra = [[{"role": "user", "content": prompt}] for _, prompt, _, _ in module.all_tasks() if prompt not in seen]
        random.Random(seed).shuffle(extra)
        chats += extra
    if n > len(chats):
        raise ValueError(f"at most {len(chats)} distinct prompts, asked for {n}")
    return chats[:n]


def build_hs_dir(dest: Path, n: int = 24, aux_layers=(2, 4, 5), seed: int = 0) -> Path:
    """n samples (prompt + the target's greedy answer, loss mask over the answer) in `dest`:
    a save_to_disk dataset (input_ids, loss_mask, seq_len) and hidden_states/hs_{i}.safetensors
    with hidden_states [seq, len(aux_layers) + 1, H] bf16 and token_ids [seq]."""
    import datasets
    from transformers import AutoTokenizer

    from eyrie_extractor.capture import HFCapture

    dest = Path(dest)
    (dest / "hidden_states").mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hidden size 64 gains nothing from threads, and loses a lot on a busy machine
    try:
        capture = HFCapture(str(TINY), list(aux_layers), "cpu")  # its model also writes the answers
        columns = _write_samples(dest / "hidden_states", tokenizer, capture, _chats(n, seed))
    finally:
        torch.set_num_threads(threads)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")  # as `eyrie materialize` and speculators' prepare-data save it
    dataset.save_to_disk(str(dest))
    return dest


@torch.inference_mode()
def _write_samples(folder: Path, tokenizer, capture, chats: list[list[dict]]) -> dict[str, list]:
    from safetensors.torch import save_file

    from eyrie_extractor.shard import sample_tensors

    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for index, messages in enumerate(chats):
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True, enable_thinking=True)["input_ids"])
        prompt_ids = torch.tensor([prompt])
        out = capture.model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                     do_sample=False, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id)
        ids = out[0].tolist()
        states = capture.forward([ids])[0].cpu()
        save_file(sample_tensors(states, ids, "bf16"), str(folder / f"hs_{index}.safetensors"))
        columns["input_ids"].append(ids)
        columns["loss_mask"].append([0] * len(prompt) + [1] * (len(ids) - len(prompt)))
        columns["seq_len"].append(len(ids))
    return columns
