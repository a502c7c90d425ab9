"""A generated record to the exact tokens the target saw and produced, and its loss mask."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rendered:
    input_ids: list[int]
    prompt_len: int  # loss mask: 0 over the prompt, 1 over the assistant tokens after it
    source: str  # server_token_ids | chat_template
    mismatch: bool = False  # both were available and disagreed


def render(record: dict, tokenizer, think: tuple[str, str]) -> Rendered:
    """The server's token ids where the record has them (exactly what the target produced);
    otherwise the target's chat template with the reasoning inside its think markers."""
    templated = _from_template(record, tokenizer, think) if tokenizer is not None else None
    prompt_ids, completion_ids = record.get("prompt_token_ids"), record.get("completion_token_ids")
    if prompt_ids and completion_ids:
        ids = list(prompt_ids) + list(completion_ids)
        mismatch = templated is not None and templated.input_ids != ids
        return Rendered(ids, len(prompt_ids), "server_token_ids", mismatch)
    if templated is None:
        raise ValueError("record has no token ids and no tokenizer was given")
    return templated


def _from_template(record: dict, tokenizer, think: tuple[str, str]) -> Rendered:
    text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    reply = record.get("content") or ""
    if record.get("reasoning") is not None:
        opened = text.rstrip().endswith(think[0])  # templates that open the think block themselves
        reply = f"{'' if opened else think[0]}{record['reasoning']}{think[1]}{reply}"
    # The assistant turn as the target generated it: its tokens, then its end-of-turn token.
    completion = tokenizer.encode(reply, add_special_tokens=False)
    if record.get("finish_reason") == "stop" and tokenizer.eos_token_id is not None:
        completion.append(tokenizer.eos_token_id)
    return Rendered(list(prompt) + completion, len(prompt), "chat_template")


def fit(rendered: Rendered, max_length: int | None) -> tuple[Rendered | None, str | None]:
    """The stated rule for long samples: keep the first max_length tokens when some assistant
    tokens remain (counted as truncated); skip the sample when the prompt alone fills it."""
    if max_length is None or len(rendered.input_ids) <= max_length:
        return rendered, None
    if rendered.prompt_len >= max_length:
        return None, "prompt_exceeds_max_length"
    return Rendered(rendered.input_ids[:max_length], rendered.prompt_len, rendered.source,
                    rendered.mismatch), "truncated"
