"""A generated record to the exact tokens the target saw and produced, and its loss mask: every
assistant answer of the conversation supervised, never a user turn."""

from __future__ import annotations

from dataclasses import dataclass

from eyrie.data.prompts import before_assistant


@dataclass
class Rendered:
    input_ids: list[int]
    spans: list[list[int]]  # [start, end) of each answer the loss mask covers, in order
    source: str  # server_token_ids | chat_template
    mismatch: bool = False  # both were available and disagreed
    turns_rerendered: int = 0  # earlier answers the final context holds otherwise than the target wrote them
    turns_unsupervised: int = 0  # earlier answers that could not be placed in the final context

    @property
    def prompt_len(self) -> int:
        """Tokens before the first supervised one (the first request's prompt)."""
        return self.spans[0][0]


@dataclass
class Turn:
    prompt: list[int]
    completion: list[int]
    stopped: bool  # ended on its end-of-turn token (the completion's last id), not cut at max_tokens


def render(record: dict, tokenizer, think: tuple[str, str]) -> Rendered:
    """The server's token ids where the record has them for every turn (exactly what the target
    produced); otherwise the target's chat template with the reasoning inside its think markers."""
    templated = _from_template(record, tokenizer, think) if tokenizer is not None else None
    turns = record.get("turns") or [record]
    if all(t.get("prompt_token_ids") and t.get("completion_token_ids") for t in turns):
        rendered = _conversation([Turn(list(t["prompt_token_ids"]), list(t["completion_token_ids"]),
                                       t.get("finish_reason") == "stop") for t in turns], "server_token_ids")
        rendered.mismatch = templated is not None and templated.input_ids != rendered.input_ids
        return rendered
    if templated is None:
        raise ValueError("record has no token ids and no tokenizer was given")
    return templated


def _conversation(turns: list[Turn], source: str) -> Rendered:
    """The last request's prompt and answer are the whole conversation (every earlier answer is in its
    context, as the chat template put it back); each earlier answer is supervised there, from where
    its own request's prompt ends to its end-of-turn token, as every trainer of multi-turn drafters
    does. A template that puts an answer back other than the target wrote it (without its reasoning,
    say) is counted (`turns_rerendered`); one whose prompt the final context does not begin with
    cannot be placed and is counted unsupervised."""
    last = turns[-1]
    ids = last.prompt + last.completion
    spans, rerendered, unsupervised = [], 0, 0
    for turn in turns[:-1]:
        span = _placed(ids, len(last.prompt), turn)
        if span is None:
            unsupervised += 1
            continue
        spans.append(span)
        rerendered += ids[span[0]:span[1]] != turn.completion
    spans.append([len(last.prompt), len(ids)])
    return Rendered(ids, spans, source, turns_rerendered=rerendered, turns_unsupervised=unsupervised)


def _placed(ids: list[int], limit: int, turn: Turn) -> list[int] | None:
    """[start, end) of an earlier answer inside the final prompt ids[:limit], or None."""
    start = len(turn.prompt)
    if ids[:start] != turn.prompt or start >= limit:
        return None
    if ids[start:start + len(turn.completion)] == turn.completion:
        return [start, start + len(turn.completion)]
    if turn.stopped:  # re-rendered: up to its end-of-turn token
        end_token = turn.completion[-1]
        end = next((j for j in range(start, limit) if ids[j] == end_token), None)
        return None if end is None else [start, end + 1]
    length = _common_prefix(ids[start:limit], turn.completion)
    return [start, start + length] if length else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _from_template(record: dict, tokenizer, think: tuple[str, str]) -> Rendered:
    answers = record.get("turns") or [record]
    messages = record["messages"]
    turns = [Turn(*_templated_turn(tokenizer, think, _request_of(messages, i, len(answers)), answer),
                  answer.get("finish_reason") == "stop" and tokenizer.eos_token_id is not None)
             for i, answer in enumerate(answers)]
    return _conversation(turns, "chat_template")


def _request_of(messages: list[dict], index: int, count: int) -> list[dict]:
    """The messages of the `index`-th request: the final request's messages up to its `index`-th
    assistant message (the target's own answers to the requests before it)."""
    if index == count - 1:
        return messages
    cut = before_assistant(messages, index + 1)
    if cut is None:
        raise ValueError(f"record has {count} answers but its messages hold fewer earlier answers than {index + 1}")
    return messages[:cut]


def _templated_turn(tokenizer, think: tuple[str, str], messages: list[dict], answer: dict) -> tuple[list, list]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    reply = answer.get("content") or ""
    if answer.get("reasoning") is not None:
        opened = text.rstrip().endswith(think[0])  # templates that open the think block themselves
        reply = f"{'' if opened else think[0]}{answer['reasoning']}{think[1]}{reply}"
    # The assistant turn as the target generated it: its tokens, then its end-of-turn token.
    completion = tokenizer.encode(reply, add_special_tokens=False)
    if answer.get("finish_reason") == "stop" and tokenizer.eos_token_id is not None:
        completion.append(tokenizer.eos_token_id)
    return prompt, completion


def fit(rendered: Rendered, max_length: int | None) -> tuple[Rendered | None, str | None]:
    """The stated rule for long samples: keep the first max_length tokens when some assistant
    tokens remain (counted as truncated), and of those none after the last answer kept (a user turn
    cut there feeds no supervised position); skip the sample when the prompt alone fills it."""
    if max_length is None or len(rendered.input_ids) <= max_length:
        return rendered, None
    if rendered.prompt_len >= max_length:
        return None, "prompt_exceeds_max_length"
    spans = [[start, min(end, max_length)] for start, end in rendered.spans if start < max_length]
    return Rendered(rendered.input_ids[:spans[-1][1]], spans, rendered.source, rendered.mismatch,
                    rendered.turns_rerendered, rendered.turns_unsupervised), "truncated"
