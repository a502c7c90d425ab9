"""A row's conversation answered turn by turn (`generate.turns: all`): one request per user turn, the
target's own earlier answers in the context, and one record that keeps every turn's exact answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from eyrie.data.prompts import before_assistant
from eyrie_generator.client import Completion

TURN_FIELDS = ("reasoning", "reasoning_source", "content", "finish_reason", "usage", "prompt_token_ids",
               "completion_token_ids", "attempts", "latency_s")

Ask = Callable[[list[dict]], Awaitable[Completion]]


async def answer_turns(requests: list[list[dict]], ask: Ask) -> dict:
    """The record fields of a conversation whose i-th request adds `requests[i]` (its system and user
    messages) after the target's answer to the one before. A turn that fails fails the sample, naming
    the turn; a later turn that cannot fit the context ends the conversation there (`turns_cut`)."""
    context: list[dict] = []
    answers: list[Completion] = []
    for number, added in enumerate(requests, start=1):
        context = context + added
        result = await ask(context)
        if result.status != "done":
            return _ended(result, number, len(requests), context, answers)
        answers.append(result)
        if number < len(requests):
            context = context + [{"role": "assistant", "content": result.content or ""}]
    return _record(context, answers)


def _ended(result: Completion, number: int, total: int, context: list[dict], answers: list[Completion]) -> dict:
    if total == 1 or not answers and result.status == "skipped":
        return {"messages": context, **result.__dict__}
    if result.status == "skipped":
        cut = before_assistant(context, len(answers))
        done = _record(context if cut is None else context[:cut], answers)
        return {**done, "turns_cut": {"turn": number, "of": total, "reason": result.reason}}
    failed = {**result.__dict__, "error": f"turn {number} of {total}: {result.error}"}
    return {"messages": context, **failed, **({"turns": [_turn(a) for a in answers]} if answers else {})}


def _record(context: list[dict], answers: list[Completion]) -> dict:
    """One answer: the record as a single request makes it. Several: the last answer's fields at the
    top (its request's messages and token ids hold the whole conversation), the usage summed, and
    every answer in `turns`."""
    last = answers[-1]
    if len(answers) == 1:
        return {"messages": context, **last.__dict__}
    usage: dict = {}
    for answer in answers:
        for name, value in (answer.usage or {}).items():
            if isinstance(value, int):
                usage[name] = usage.get(name, 0) + value
    return {"messages": context, **last.__dict__, "usage": usage,
            "attempts": sum(a.attempts for a in answers), "latency_s": sum(a.latency_s for a in answers),
            "turns": [_turn(a) for a in answers]}


def _turn(answer: Completion) -> dict:
    return {name: getattr(answer, name) for name in TURN_FIELDS}
