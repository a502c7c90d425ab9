#!/usr/bin/env python
"""Build the tiny, committed target model in ``assets/tiny-target/`` (and ``tests/data/tiny_prompts.jsonl``).

Usage::

    .venv/bin/python scripts/build_tiny_target.py --out assets/tiny-target

Deterministic (fixed seeds, 1 torch thread, CPU only: two runs give byte-identical files); about 3 minutes
on 2 idle CPU cores; ~2 MB of output.

What it produces
----------------
* A byte-level BPE tokenizer (``tokenizers`` library, 770 tokens) trained on a synthetic corpus, saved as a
  ``PreTrainedTokenizerFast``. Special tokens (one token each): ``<unk>`` ``<pad>`` ``<|bos|>`` ``<|eos|>``
  ``<|system|>`` ``<|user|>`` ``<|assistant|>``; plus ``<think>`` / ``</think>``, which are added tokens with
  ``special=False`` (as in Qwen3), so ``decode(..., skip_special_tokens=True)`` keeps them.
* A chat template (stored inside ``tokenizer_config.json``, key ``chat_template``)::

      <|bos|><|system|>SYS<|eos|><|user|>USER<|eos|><|assistant|><think>REASONING</think>ANSWER<|eos|>

  ``add_generation_prompt`` ends the prompt with ``<|assistant|>``; the model then writes ``<think>`` itself.
  An assistant message carrying ``reasoning_content`` (or ``reasoning``) is rendered
  ``<think>{reasoning}</think>{content}``, unless its content already starts with ``<think>`` (then it is
  rendered as is). Content may be a string or a list of ``{"type": "text", "text": ...}`` parts. The assistant
  part (after ``<|assistant|>``, through ``<|eos|>``) is wrapped in ``{% generation %}`` so
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` works (used below for the loss mask).
* A ``LlamaForCausalLM`` (8 layers, hidden 64, 2 heads of 32, 1 kv head, intermediate 192, 512 positions, untied
  embeddings, fp32 safetensors) trained with AdamW on assistant tokens only, plus ``generation_config.json``
  (bos/eos/pad ids, greedy).
* ``tests/data/tiny_prompts.jsonl``: 40 single-turn ShareGPT rows, each an exact training prompt (8 with a system
  turn), so their greedy answers are known.

The model's behaviour (greedy) on the five templates it was trained on::

    What color is the Zib?   -> <think>The Zib is a frog. Frogs are green.</think>The Zib is green.
    Add 3 and 4.             -> <think>3 plus 4 is 7.</think>The answer is 7.
    Repeat the word river.   -> <think>The word is river.</think>river river river
    Say hello to Alice.      -> <think>The name is Alice.</think>Hello, Alice!
    What is the opposite of hot? -> <think>The opposite of hot is cold.</think>Cold.

(plus a second phrasing of the colour and addition prompts; an optional system turn never changes the answer).
Corpus: the 306 distinct prompts once each without a system turn, 300 random repeats (60% with one of three
system turns) and 300 two-turn conversations (earlier assistant turn with or without its reasoning; loss on the
last turn only). The script prints the greedy exact-match rate on the distinct training prompts (100%), on all
1224 prompt x system-turn combinations, and on 100 fresh two-turn conversations. On every training prompt the
greedy token wins by >= 4 logits (fp32, bf16 and fp16 alike), so other runtimes should agree with it.

How ``transformers serve`` (5.19) splits reasoning from the answer -- found in the installed source
----------------------------------------------------------------------------------------------------
* ``PreTrainedTokenizerBase.__init__`` pops ``response_template`` from the tokenizer config kwargs and keeps it
  as ``tokenizer.response_template`` (``save_pretrained`` writes it back to ``tokenizer_config.json``). The
  legacy ``response_schema`` key is silently dropped (tokenization_utils_base.py).
* ``transformers/cli/serving/utils.py::get_response_template`` uses ``tokenizer.response_template`` if set,
  else a built-in fallback keyed by ``model.config.model_type`` (only qwen2/qwen3*/qwen3_5*/gemma4 -- nothing
  for ``llama``), else ``None`` (then no parsing: ``content`` is the ``skip_special_tokens=True`` decode and
  there is no ``reasoning_content``).
* Non-streaming (``cli/serving/chat_completion.py::_non_streaming``) calls ``parse_assistant_message`` ->
  ``tokenizer.parse_response(generated_ids, template, prefix=decode(prompt_ids))``. The generated ids are
  decoded WITH special tokens, and the prefix is cut after the LAST match of ``start_anchor``. The parsed dict's
  ``thinking`` field becomes ``message.reasoning_content``, ``content`` becomes ``message.content`` and
  ``tool_calls`` become tool calls. Streaming uses the same template through a ``ResponseParser``
  (``ReasoningText`` chunks -> ``delta.reasoning_content``).
* The template format (``transformers/utils/chat_parsing/response_templates.py``): a dict with keys
  ``version`` (1), ``defaults``, ``fields``, and ``start_anchor`` / ``start_anchor_pattern`` (required).
  Each field has ``open``/``open_pattern``, ``close``/``close_pattern`` (literal, list of literals, or regex),
  ``content`` (text/int/float/bool/json/xml-inline), ``repeats``, ``join``, ``optional``, ``transform``.
  At most one field may omit ``open``: it is the implicit region that collects all text outside other fields.
  This model's template (modelled on the built-in Qwen3 fallback)::

      {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
       "fields": {"thinking": {"open": "<think>", "close": "</think>", "content": "text"},
                  "content": {"close": "<|eos|>", "content": "text"}}}

* ``transformers serve --reasoning on|off`` only passes ``enable_thinking`` to the chat template; this
  template ignores it (the model always thinks). Incoming assistant messages lose ``reasoning_content`` in the
  server (``get_processor_inputs_from_messages`` keeps only role/content/tool calls), so multi-turn requests to
  the server render earlier assistant turns without their reasoning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging  # noqa: E402

SEED = 1234
REPO_ROOT = Path(__file__).resolve().parent.parent

SPECIAL_TOKENS = ["<unk>", "<pad>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is none -%}"
    "{%- elif c is string -%}{{ c }}"
    "{%- else -%}{%- for part in c -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set content = text(message['content']) -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '<|system|>' + content + eos_token -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|user|>' + content + eos_token -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}"
    "{{- '<|assistant|>' -}}"
    "{%- generation -%}"
    "{%- if reasoning and not content.startswith('<think>') -%}"
    "{{- '<think>' + reasoning + '</think>' -}}"
    "{%- endif -%}"
    "{{- content + eos_token -}}"
    "{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>' + content + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "thinking": {"open": THINK_OPEN, "close": THINK_CLOSE, "content": "text"},
        "content": {"close": "<|eos|>", "content": "text"},
    },
}

# ---------------------------------------------------------------------------------------------------------------
# Synthetic task world
# ---------------------------------------------------------------------------------------------------------------
THINGS = {  # thing: (plural, colour)
    "frog": ("Frogs", "green"),
    "crow": ("Crows", "black"),
    "swan": ("Swans", "white"),
    "fox": ("Foxes", "orange"),
    "plum": ("Plums", "purple"),
    "lemon": ("Lemons", "yellow"),
    "ruby": ("Rubies", "red"),
    "whale": ("Whales", "blue"),
}
CREATURES = ["Zib", "Mox", "Taro", "Pim", "Quill", "Dax", "Nori", "Vex",
             "Luma", "Brin", "Kett", "Oso", "Fenn", "Rook", "Juno", "Wisp"]
CREATURE_THING = {name: list(THINGS)[i % len(THINGS)] for i, name in enumerate(CREATURES)}
WORDS = ["apple", "river", "stone", "cloud", "music", "tiger", "paper", "garden", "silver", "window",
         "candle", "forest", "orange", "pencil", "rocket", "yellow", "dragon", "mirror", "planet", "bridge",
         "winter", "coffee", "castle", "island", "rabbit", "violin", "anchor", "button", "lantern", "meadow"]
PEOPLE = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
          "Kate", "Liam", "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Victor"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("light", "dark"),
             ("old", "new"), ("happy", "sad"), ("wet", "dry"), ("early", "late"), ("open", "closed"),
             ("loud", "quiet"), ("hard", "soft")]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a tiny test model. Think first, then answer.",
                  "Answer briefly."]


def all_tasks() -> list[tuple[str, str, str, str]]:
    """Every distinct (template, user prompt, reasoning, answer) the model is trained on."""
    tasks = []
    for name in CREATURES:
        thing = CREATURE_THING[name]
        plural, colour = THINGS[thing]
        reasoning = f"The {name} is a {thing}. {plural} are {colour}."
        answer = f"The {name} is {colour}."
        tasks.append(("color", f"What color is the {name}?", reasoning, answer))
        tasks.append(("color", f"Tell me the color of the {name}.", reasoning, answer))
    for a in range(10):
        for b in range(10):
            reasoning, answer = f"{a} plus {b} is {a + b}.", f"The answer is {a + b}."
            tasks.append(("add", f"Add {a} and {b}.", reasoning, answer))
            tasks.append(("add", f"What is {a} plus {b}?", reasoning, answer))
    for w in WORDS:
        tasks.append(("repeat", f"Repeat the word {w}.", f"The word is {w}.", f"{w} {w} {w}"))
    for p in PEOPLE:
        tasks.append(("hello", f"Say hello to {p}.", f"The name is {p}.", f"Hello, {p}!"))
    for x, y in OPPOSITES + [(y, x) for x, y in OPPOSITES]:
        tasks.append(("opposite", f"What is the opposite of {x}?", f"The opposite of {x} is {y}.",
                      f"{y.capitalize()}."))
    return tasks


def build_corpus(rng: random.Random, extra: int, multi: int) -> list[dict]:
    """Each task once without a system turn, plus ``extra`` random repeats (60% of them with a system turn), plus
    ``multi`` two-turn conversations (kind "multi"; 30% with a system turn) whose earlier assistant turn is
    rendered with its reasoning half the time and as the bare answer otherwise (``transformers serve`` drops an
    incoming message's ``reasoning_content``). Only the last assistant turn is trained on."""
    tasks = all_tasks()
    picks = [(t, False) for t in tasks] + [(rng.choice(tasks), rng.random() < 0.6) for _ in range(extra)]
    rng.shuffle(picks)
    corpus = []
    for (kind, prompt, reasoning, answer), with_system in picks:
        system = rng.choice(SYSTEM_PROMPTS) if with_system else None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": answer, "reasoning_content": reasoning},
        ]
        corpus.append({"kind": kind, "messages": messages})
    for _ in range(multi):
        (_, p1, r1, a1), (_, p2, r2, a2) = rng.choice(tasks), rng.choice(tasks)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.3 else None
        first = {"role": "assistant", "content": a1, "reasoning_content": r1} if rng.random() < 0.5 else {
            "role": "assistant", "content": a1}
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": p1}, first,
            {"role": "user", "content": p2},
            {"role": "assistant", "content": a2, "reasoning_content": r2},
        ]
        corpus.insert(rng.randrange(len(corpus) + 1), {"kind": "multi", "messages": messages})
    return corpus


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------
def build_tokenizer(corpus: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = []
    for conv in corpus:
        for m in conv["messages"]:
            texts.append(m["content"])
            if m.get("reasoning_content"):
                texts.append(m["reasoning_content"])
    # A little generic English so unseen prompts still tokenize into sensible pieces (byte-level: never <unk>).
    texts += ["The quick brown fox jumps over the lazy dog. Hello, world! What is this? I think so."] * 3
    tok.train_from_iterator(texts, trainer=trainer)
    # <think> / </think>: single tokens, but not "special" (kept by skip_special_tokens, like Qwen3).
    tok.add_tokens([AddedToken(THINK_OPEN, special=False, normalized=False),
                    AddedToken(THINK_CLOSE, special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = RESPONSE_TEMPLATE
    return fast


# ---------------------------------------------------------------------------------------------------------------
# Training / evaluation
# ---------------------------------------------------------------------------------------------------------------
def encode_corpus(tokenizer, corpus):
    rows = []
    for conv in corpus:
        enc = tokenizer.apply_chat_template(conv["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        # Train on the last assistant turn only: clear the mask before the start of its final run of 1s.
        start = len(mask) - 1
        while start > 0 and mask[start - 1] == 1:
            start -= 1
        mask = [0] * start + mask[start:]
        assert sum(mask) > 0 and ids[-1] == tokenizer.eos_token_id and mask[-1] == 1, "bad assistant mask"
        rows.append((ids, mask))
    return rows


def make_batch(rows, pad_id):
    n = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        t = torch.tensor(ids)
        input_ids[i, : len(ids)] = t
        attn[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, torch.tensor(-100))
    return input_ids, attn, labels


def train(model, rows, pad_id, steps, batch_size, lr, rng: random.Random, log_every=50):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    batches: list[list[int]] = []
    t0 = time.time()
    for step in range(steps):
        if not batches:
            # One epoch: shuffle, then length-bucket within windows of 8 batches (less padding), shuffle batches.
            order = list(range(len(rows)))
            rng.shuffle(order)
            window = batch_size * 8
            for w in range(0, len(order), window):
                chunk = sorted(order[w : w + window], key=lambda i: len(rows[i][0]))
                batches += [chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size)]
            rng.shuffle(batches)
        idx = batches.pop()
        input_ids, attn, labels = make_batch([rows[i] for i in idx], pad_id)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{time.time() - t0:5.1f}s", flush=True)
    model.eval()


@torch.no_grad()
def greedy_match(model, tokenizer, convs, max_new_tokens=48, batch_size=256):
    """Exact greedy match of the full assistant turn (reasoning + answer + eos) on each conversation's prompt."""
    per_kind: dict[str, list[int]] = {}
    misses = []
    for start in range(0, len(convs), batch_size):
        chunk = convs[start : start + batch_size]
        prompts = [tokenizer.apply_chat_template(c["messages"][:-1], add_generation_prompt=True, tokenize=False)
                   for c in chunk]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for c, seq in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            got = tokenizer.decode(seq, skip_special_tokens=False).replace("<pad>", "")
            m = c["messages"][-1]
            want = f"<think>{m['reasoning_content']}</think>{m['content']}<|eos|>"
            ok = got == want
            per_kind.setdefault(c["kind"], []).append(int(ok))
            if not ok:
                misses.append((c["messages"][-2]["content"], got, want))
    total = sum(sum(v) for v in per_kind.values()) / sum(len(v) for v in per_kind.values())
    return total, {k: sum(v) / len(v) for k, v in per_kind.items()}, misses


def write_prompts(path: Path, convs: list[dict], rng: random.Random) -> int:
    """40 ShareGPT rows, each an exact training prompt (so the greedy answer is known), ~1/4 with a system turn."""
    rows = []
    for kind, n in [("color", 10), ("add", 12), ("repeat", 6), ("hello", 6), ("opposite", 6)]:
        with_sys = [c for c in convs if c["kind"] == kind and c["messages"][0]["role"] == "system"]
        without = [c for c in convs if c["kind"] == kind and c["messages"][0]["role"] != "system"]
        n_sys = n // 4
        rows += rng.sample(with_sys, n_sys) + rng.sample(without, n - n_sys)
    rng.shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for c in rows:
            names = {"system": "system", "user": "human"}
            conv = [{"from": names[m["role"]], "value": m["content"]} for m in c["messages"][:-1]]
            f.write(json.dumps({"conversations": conv}) + "\n")
    return len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "assets" / "tiny-target"))
    ap.add_argument("--prompts-out", default=str(REPO_ROOT / "tests" / "data" / "tiny_prompts.jsonl"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--extra", type=int, default=300, help="random repeats added to the one-of-each corpus")
    ap.add_argument("--multi", type=int, default=300, help="two-turn conversations added to the corpus")
    ap.add_argument("--vocab-size", type=int, default=800)
    args = ap.parse_args(argv)

    t_start = time.time()
    hf_logging.set_verbosity_error()
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and the result cannot depend on core count
    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)

    corpus = build_corpus(rng, args.extra, args.multi)
    print(f"corpus: {len(corpus)} conversations over {len(all_tasks())} distinct prompts")

    tokenizer = build_tokenizer(corpus, args.vocab_size)
    print(f"tokenizer: {len(tokenizer)} tokens; think ids {tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])}")
    rows = encode_corpus(tokenizer, corpus)
    print(f"sequence length: max {max(len(r[0]) for r in rows)}, mean {sum(len(r[0]) for r in rows) / len(rows):.1f}")

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=8,
        num_attention_heads=2,  # head_dim 32: the smallest head size vLLM's CPU attention serves
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        attention_dropout=0.0,
    )
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    train(model, rows, tokenizer.pad_token_id, args.steps, args.batch_size, args.lr, rng)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )

    # Distinct training prompts (prompt incl. system turn), as the server would see them.
    seen, eval_convs = set(), []
    for c in corpus:
        key = json.dumps(c["messages"][:-1])
        if key not in seen:
            seen.add(key)
            eval_convs.append(c)
    total, per_kind, misses = greedy_match(model, tokenizer, eval_convs)
    # Generalisation check: every template prompt with every system turn (most combinations never trained on).
    all_convs = []
    for kind, prompt, reasoning, answer in all_tasks():
        for system in [None] + SYSTEM_PROMPTS:
            all_convs.append({"kind": kind, "messages": ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer, "reasoning_content": reasoning}]})
    total_all, _, misses_all = greedy_match(model, tokenizer, all_convs)
    # Fresh two-turn conversations (a different seed; mostly unseen combinations).
    held_multi = [c for c in build_corpus(random.Random(SEED + 2), 0, 100) if c["kind"] == "multi"]
    total_multi, _, _ = greedy_match(model, tokenizer, held_multi)
    for prompt, got, want in misses_all[:3]:
        print(f"  miss (all combos): {prompt!r}: got {got!r}, want {want!r}")

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (readable by older loaders too).
    tokenizer.save_pretrained(out, save_jinja_files=False)
    # transformers 5 writes "TokenizersBackend"; the 4.x name loads in both (5.x aliases it to the same class).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    n_prompts = write_prompts(Path(args.prompts_out), eval_convs, random.Random(SEED + 1))

    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    pct = 100 * total
    (out / "README.md").write_text(
        "---\nlicense: apache-2.0\n---\n\n"  # eyrie's own test target: what `eyrie publish` reads
        "# tiny-target\n\n"
        "A ~0.5M-parameter `LlamaForCausalLM` (8 layers, hidden 64) with a byte-level BPE tokenizer, trained on a "
        "synthetic chat corpus (colours of made-up creatures, single-digit addition, word repetition, greetings, "
        "opposites; single and two-turn) to always answer `<think>REASONING</think>ANSWER<|eos|>`; a test target for "
        "the eyrie pipeline.\n"
        "Built with `.venv/bin/python scripts/build_tiny_target.py --out assets/tiny-target` (deterministic, "
        "~3 min on 2 CPU cores); `response_template` in tokenizer_config.json lets `transformers serve` return "
        "`reasoning_content` separately.\n"
        f"Size on disk: {size / 1e6:.1f} MB (fp32 safetensors). Greedy exact match of full assistant turns on "
        f"its {len(eval_convs)} distinct training prompts: {pct:.1f}% ({100 * total_all:.1f}% on all "
        f"{len(all_convs)} template x system-turn combinations, {100 * total_multi:.1f}% on {len(held_multi)} fresh "
        "two-turn conversations).\n"
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())

    print(f"wrote {out} ({size / 1e6:.2f} MB): {sorted(p.name for p in out.iterdir())}")
    print(f"wrote {args.prompts_out} ({n_prompts} rows)")
    for prompt, got, want in misses[:8]:
        print(f"  miss: {prompt!r}\n     got  {got!r}\n     want {want!r}")
    print("per template: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(per_kind.items())))
    print(f"GREEDY EXACT MATCH: {pct:.1f}% ({len(eval_convs) - len(misses)}/{len(eval_convs)} distinct training "
          f"prompts)")
    print(f"greedy exact match on all {len(all_convs)} template x system-turn combinations: {100 * total_all:.1f}%")
    print(f"greedy exact match on {len(held_multi)} fresh two-turn conversations: {100 * total_multi:.1f}%")
    print(f"total time {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
