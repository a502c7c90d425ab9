"""The training recipe eyrie chooses when train: leaves it to it: from the number of training tokens
and where training runs. What a small set lacks is optimizer steps, not epochs: drafters for
SmolLM2-135M trained on 70 and 210 prompts in about 12 and 32 steps learnt nothing (τ 1.00-1.04 in
vLLM); 400 prompts at lr 1e-3, 1,024-token packs, 8 epochs (1,094 steps) reached 2.17 on GSM8K test
(issue 28, shared/FIELD-NOTES.md "Training a drafter on little compute"). So the epochs are chosen
to give about TARGET_STEPS optimizer steps, within [MIN_EPOCHS, MAX_EPOCHS]."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# The measured SmolLM2 recipe: 1,094 steps (8 epochs of 400 prompts) reached 2.17 on GSM8K test; the
# defaults' rerun ran 1,246 (8 epochs) and reached 2.23, its held-out τ still rising at the last epoch.
TARGET_STEPS = 1200
# At least 2: the best epoch is kept by held-out τ, and one epoch leaves nothing to choose from.
MIN_EPOCHS = 2
MAX_EPOCHS = 20  # speculators' own default epoch count
# On a CPU attention is dense (speculators builds an [L x ttt*L] float mask for SDPA): cost per token
# grows with the pack length. Measured there: 1,024-token packs train 2.7-3.4x the tokens per CPU-second
# of 4,096 (512 loses it to padding), and give 4x the steps per epoch. On a GPU flex attention's block
# mask does not grow so: speculators' default 8,192.
CPU_PACK, GPU_PACK = 1024, 8192
# The share of a pack speculators' packer fills with GSM8K-length samples (~100-500 tokens), measured:
# the 400-prompt run planned 1,104 steps at 0.9 and ran 1,246 (0.80; bench/RESULTS.md).
PACK_FILL = 0.8


@dataclass(frozen=True)
class Recipe:
    lr: float
    warmup: float
    schedule: str
    seq_len: int
    epochs: int
    steps: int  # estimated optimizer steps in all (speculators packs each epoch anew)
    why: str

    def statement(self) -> str:
        """e.g. 'lr 1e-3, warmup 3%, linear decay, 1,024-token packs, 8 epochs = 1,096 steps, because ...'."""
        return (f"lr {short(self.lr)}, warmup {self.warmup:.0%}, {self.schedule} decay, {self.seq_len:,}-token packs, "
                f"{self.epochs} epochs = {self.steps:,} steps, because {self.why}")


def short(value: float) -> str:
    """1e-3, not 0.001; 1.5e-4."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def trainer_device(setting: str) -> str:
    """Where training will run, without importing torch (for plans made away from the trainer):
    EYRIE_DEVICE as set, or auto: cuda where this host has an NVIDIA device."""
    if setting != "auto":
        return setting
    return "cuda" if Path("/dev/nvidiactl").exists() else "cpu"


def pack_length(given: int | None, device: str) -> int:
    return given or (GPU_PACK if device.startswith("cuda") else CPU_PACK)


def steps_per_epoch(train_tokens: int, seq_len: int) -> int:
    return max(1, math.ceil(train_tokens / (seq_len * PACK_FILL)))


def choose(train_tokens: int, device: str, *, lr: float, warmup: float, schedule: str, seq_len: int | None = None,
           epochs: int | None = None) -> Recipe:
    """`train_tokens`: the training samples' tokens (each cut at the pack length); the others as given
    (epochs and seq_len None: chosen here)."""
    pack = pack_length(seq_len, device)
    per_epoch = steps_per_epoch(train_tokens, pack)
    where = "a GPU's" if device.startswith("cuda") else "a CPU's: its dense attention costs more per token in longer packs"
    if epochs is not None:
        why = f"the epochs were given; {pack:,}-token packs are {where}"
        return Recipe(lr, warmup, schedule, pack, epochs, per_epoch * epochs, why)
    chosen = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_STEPS / per_epoch)))
    bound = {MAX_EPOCHS: f", capped at {MAX_EPOCHS} epochs", MIN_EPOCHS: f", at least {MIN_EPOCHS} epochs"}
    why = (f"{train_tokens:,} training tokens make ~{per_epoch:,} steps an epoch in {pack:,}-token packs ({where}), "
           f"and a drafter needs ~{TARGET_STEPS:,} optimizer steps (steps, not epochs, are what a small set lacks"
           f"{bound.get(chosen, '')}); the best epoch is kept by held-out τ")
    return Recipe(lr, warmup, schedule, pack, chosen, per_epoch * chosen, why)
