"""Know before you spend: can the pinned vLLM extract hidden states from this target and serve an
EAGLE-3 drafter for it? Both need the model class to implement SupportsEagle3 (vLLM's
gpu_model_runner refuses `eagle3` and `extract_hidden_states` otherwise); the table is read from
vLLM's own source by scripts/vllm_eagle3_table.py (docs/planning.md)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.target import refuse_remote_code

TABLE = Path(__file__).with_name("vllm_support.json")


@cache
def table() -> dict:
    return json.loads(TABLE.read_text())


def check(architecture: str | None, backend: str) -> dict:
    """What the pinned vLLM can do for this architecture; `refusal` (problem, fix) when the
    configured run cannot work, `warning` when a later stage cannot."""
    t = table()
    row = t["architectures"].get(architecture or "")
    out = {"architecture": architecture, "vllm": t["vllm"], "file": row[0] if row else None,
           "class": row[1] if row else None, "eagle3": row[2] if row else None,
           "refusal": None, "warning": None}
    if architecture is None:
        out["warning"] = ("the target's architecture is unknown here (its config.json cannot be read): "
                          "support unchecked; add target.shape.architecture to the run config.")
    elif row is None:
        out["warning"] = (f"vLLM {t['vllm']} has no model class for {architecture}: it cannot serve the target "
                          "nor an EAGLE-3 drafter for it (generation needs another OpenAI server).")
        if backend == "vllm":
            out["refusal"] = (f"extract.backend vllm: vLLM {t['vllm']} has no model class for {architecture}.",
                              "set extract.backend: hf (the model spread over the GPUs the lease grants).")
    elif not row[2]:
        out["warning"] = (f"vLLM {t['vllm']} cannot serve an EAGLE-3 drafter for {architecture} ({row[1]} in "
                          f"{row[0]} does not implement SupportsEagle3): `eyrie verify` will be refused.")
        if backend == "vllm":
            out["refusal"] = (f"extract.backend vllm: {row[1]} ({row[0]}) does not implement SupportsEagle3 in "
                              f"vLLM {t['vllm']}, so extract_hidden_states is refused at start-up.",
                              "set extract.backend: hf (the model spread over the GPUs the lease grants).")
    return out


def refuse_unsupported(support: dict) -> None:
    if support["refusal"]:
        raise EyrieError(*support["refusal"])


def architecture(config) -> str | None:
    """config.json's architectures[0] where the target is a local directory, else target.shape's."""
    try:
        return json.loads((Path(config.target.model) / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return config.target.shape.architecture if config.target.shape else None


def refuse_unsupported_config(config) -> None:
    """`eyrie run` and POST /runs: before anything is enqueued (the architecture where it can be
    read here: a local target's config.json, or target.shape.architecture; a target that needs its
    own code where the run does not trust it)."""
    refuse_remote_code(config.target.model, config.serve.trust_remote_code)
    refuse_unsupported(check(architecture(config), config.extract.backend))
