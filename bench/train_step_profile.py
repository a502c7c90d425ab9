"""One training step of speculators' EAGLE-3 drafter at the SmolLM2-135M shape, on the CPU: where its
time goes (data, forward, backward, optimizer: speculators' own step profile) and tokens per second
and per CPU-second, for the settings given. A few steps, not a run: the machine is shared.

    .venv/bin/python bench/train_step_profile.py --dtype bfloat16 --dtype float32 --steps 6

Built in a temporary directory: a random target of SmolLM2-135M's shape (hidden 576, 30 layers, vocab
49,152, 9 heads / 3 KV heads; only what the drafter reads from a verifier: embed_tokens, model.norm,
tied lm_head) and a speculators-layout directory of random samples (token ids, bf16 hidden states
[L, 4, 576] at aux layers [2, 15, 27] + last), GSM8K-answer-like lengths. Each setting trains in a
fresh process (engine.train with eyrie's CPU shim, the sdpa + eager path eyrie takes on a CPU);
step 1 (warm-up) is left out of the figures."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192}
AUX = [2, 15, 27]


def build(work: Path, samples: int, seed: int = 0) -> tuple[Path, Path]:
    import datasets
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    target, data, g = work / "target", work / "data", torch.Generator().manual_seed(seed)
    LlamaConfig(**SHAPE).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # speculators resolves the mask token with it
        shutil.copy(ROOT / "assets" / "tiny-target" / name, target / name)
    h, v = SHAPE["hidden_size"], SHAPE["vocab_size"]
    save_file({"model.embed_tokens.weight": torch.randn(v, h, generator=g, dtype=torch.bfloat16) * 0.02,
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(target / "model.safetensors"))
    (data / "hidden_states").mkdir(parents=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i in range(samples):
        length = int(torch.randint(180, 420, (1,), generator=g))
        prompt = length // 3
        ids = torch.randint(0, 12000, (length,), generator=g)
        states = torch.randn(length, len(AUX) + 1, h, generator=g, dtype=torch.bfloat16)
        save_file({"hidden_states": states, "token_ids": ids}, str(data / "hidden_states" / f"hs_{i}.safetensors"))
        columns["input_ids"].append(ids.tolist())
        columns["loss_mask"].append([0] * prompt + [1] * (length - prompt))
        columns["seq_len"].append(length)
        for t in ids[prompt:].tolist():
            freq[t] = freq.get(t, 0) + 1
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data))
    torch.save(freq, data / "token_freq.pt")
    return target, data


def child(a) -> None:
    """One setting, this process: speculators' step profile per step, and CPU time."""
    import logging

    from eyrie_trainer import engine

    steps = []

    class Steps(logging.Handler):
        def emit(self, record):
            m = record.msg
            if record.name == "speculators.metrics" and isinstance(m, dict) and "train" in m:
                usage = resource.getrusage(resource.RUSAGE_SELF)
                steps.append({**m["profile"], "t": time.perf_counter(), "cpu_s": usage.ru_utime + usage.ru_stime})

    logging.getLogger().addHandler(Steps())
    if a.before:  # as before issue 28: bf16 wherever speculators uses it (autocast, Muon), native or not
        engine.native_bf16 = lambda device: True
    argv = json.loads(a.argv)
    engine.train(argv, "cpu", engine.Hooks())
    Path(a.out).write_text(json.dumps(steps))


def measure(work: Path, target: Path, data: Path, setting: dict, a) -> dict:
    save, out = work / "ck", work / "out.json"
    shutil.rmtree(save, ignore_errors=True)
    argv = ["--verifier-name-or-path", str(target), "--data-path", str(data), "--save-path", str(save),
            "--num-layers", "1", "--total-seq-len", str(setting["pack"]), "--num-workers", "0",
            "--draft-vocab-size", str(a.draft_vocab), "--target-layer-ids", *map(str, AUX), "--logger", "",
            "--log-dir", str(save / "logs"), "--epochs", "1", "--max-steps", str(a.steps),
            "--hidden-states-dtype", setting["dtype"], "--ttt-steps", "3", "--train-data-ratio", "0.95",
            *engine_path()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads)}
    with (work / f"{setting['dtype']}-{setting['pack']}.log").open("w") as log:
        subprocess.run([sys.executable, __file__, "--child", "--argv", json.dumps(argv), "--out", str(out),
                    *(["--before"] if setting["before"] else [])],
                       env=env, check=True, stdout=log, stderr=log)
    steps = json.loads(out.read_text())[1:]  # step 1: warm-up
    tokens = sum(s["tokens_per_s"] * s["step_ms"] / 1000 for s in steps)
    med = {k: statistics.median(s[k] for s in steps) for k in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")}
    wall = steps[-1]["t"] - steps[0]["t"] + steps[0]["step_ms"] / 1000
    cpu = steps[-1]["cpu_s"] - steps[0]["cpu_s"] + steps[0]["step_ms"] / 1000 * a.threads
    return {**setting, "steps": len(steps), "tok_s": tokens / sum(s["step_ms"] / 1000 for s in steps),
            "tok_cpu_s": tokens / cpu if cpu > 0 else None, "wall_s": wall, **med}


def engine_path() -> list[str]:
    from eyrie_trainer import engine

    return engine.path_flags(engine.SAFE_PATH)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", action="append", help="hidden_states_dtype (autocast): bfloat16, float32")
    p.add_argument("--pack", action="append", type=int, help="tokens per packed step (total_seq_len)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--before", action="store_true", help="bf16 as speculators uses it (autocast, Muon's "
                   "orthogonalization) even where the CPU emulates it: the trainer before issue 28")
    p.add_argument("--child", action="store_true")
    p.add_argument("--argv", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.child:
        return child(a)
    import torch

    work = Path(tempfile.mkdtemp(prefix="eyrie-step-"))
    print(f"work in {work}", flush=True)
    try:
        target, data = build(work, a.samples)
        print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {a.threads} thread(s), load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        for rnd in range(a.rounds):
            for dtype in a.dtype or ["bfloat16"]:
                for pack in a.pack or [1024]:
                    r = measure(work, target, data, {"dtype": dtype, "pack": pack, "before": a.before}, a)
                    print(f"round {rnd} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in r.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
