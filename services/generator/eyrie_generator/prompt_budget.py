"""Fit max_tokens to the model's context, and skip prompts that cannot fit at all."""

from __future__ import annotations

import logging
from functools import lru_cache

from eyrie.core.target import RemoteCodeRefused, load_tokenizer
from eyrie.data.prompts import Skip

log = logging.getLogger(__name__)


class PromptBudget:
    """Counts prompt tokens with the target's chat template when the tokenizer can be had.

    Without a known context length, or where transformers is not installed (the generator's image),
    it changes nothing and the server decides (a context-length 400 is then recorded as skipped:
    prompt_too_long). A target whose tokenizer needs its own code, which the run does not trust, is
    refused (RemoteCodeRefused), not counted by the server in silence.
    """

    def __init__(self, tokenizer, max_model_len: int | None):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    @classmethod
    def load(cls, model: str, max_model_len: int | None, trust_remote_code: bool = False) -> "PromptBudget":
        return cls(_tokenizer(model, trust_remote_code) if max_model_len else None, max_model_len)

    def max_tokens(self, messages: list[dict], wanted: int) -> int | Skip:
        if self.tokenizer is None or not self.max_model_len:
            return wanted
        n = len(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
        if n >= self.max_model_len:
            return Skip("prompt_too_long")
        return min(wanted, self.max_model_len - n)


@lru_cache(maxsize=4)
def _tokenizer(model: str, trust_remote_code: bool):
    try:
        return load_tokenizer(model, trust_remote_code)
    except RemoteCodeRefused:
        raise
    except Exception as exc:  # no transformers, no local copy, no hub: fall back to the server
        log.warning("no tokenizer for %s (%s): prompt lengths left to the server", model, exc)
        return None
