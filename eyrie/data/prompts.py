"""A dataset row to the chat requests the target answers, or the reason it can't be one: the prompt
row contract, read where a run is started (a usable row) and by the generator (every row)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Skip:
    reason: str


def to_prompt(row) -> list[dict] | Skip:
    """Messages up to and including the last human turn, system turns kept.

    Accepts `conversations` or `messages`, with turns as `from`/`value` (ShareGPT, as in
    mlabonne/open-perfectblend) or `role`/`content` (OpenAI, UltraChat). A null field counts as
    absent: parquet and HF datasets give every row every column (and every turn every key).
    """
    if not isinstance(row, dict):
        return Skip("row_not_an_object")
    turns = _first_set(row, "conversations", "messages")
    if turns is None:
        return Skip("no_conversation_field")
    if not isinstance(turns, list):
        return Skip("conversation_not_a_list")
    if not turns:
        return Skip("empty_conversation")
    messages = []
    for turn in turns:
        message = _to_message(turn)
        if isinstance(message, Skip):
            return message
        messages.append(message)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        return Skip("no_human_turn")
    if not messages[last_user]["content"].strip():
        return Skip("empty_prompt")
    return messages[: last_user + 1]


def to_turns(row, turns: str = "all") -> list[list[dict]] | Skip:
    """The messages each request adds to the conversation, in order (`generate.turns`).

    `all`: one request per user turn the dataset has an answer to (a user turn followed by an
    assistant turn, or ending the row), carrying the system and user messages since the last one;
    the dataset's assistant text is dropped: the target answers each turn with its own earlier
    answers in the context. `last`: one request, the row up to its last user turn as it is (the
    dataset's earlier assistant turns in the context).
    """
    prompt = to_prompt(row)
    if isinstance(prompt, Skip) or turns == "last":
        return prompt if isinstance(prompt, Skip) else [prompt]
    requests, pending = [], []
    for i, message in enumerate(prompt):
        if message["role"] == "assistant":
            continue
        pending.append(message)
        after = prompt[i + 1]["role"] if i + 1 < len(prompt) else None
        if message["role"] == "user" and after in (None, "assistant"):
            if not message["content"].strip():
                return Skip("empty_prompt")
            requests.append(pending)
            pending = []
    return requests


def _to_message(turn) -> dict | Skip:
    if not isinstance(turn, dict):
        return Skip("turn_not_an_object")
    if not turn.keys() & {"from", "value", "role", "content"}:
        return Skip("turn_without_role_or_text")
    role, text = _first_set(turn, "from", "role"), _first_set(turn, "value", "content")
    if not isinstance(role, str) or role.lower() not in ROLES:
        return Skip("unknown_role")
    if text is None:
        return Skip("null_text")
    if not isinstance(text, str):
        return Skip("text_not_a_string")
    return {"role": ROLES[role.lower()], "content": text}


def _first_set(obj: dict, *keys: str):
    """The value of the first key that is present and not null."""
    return next((obj[k] for k in keys if obj.get(k) is not None), None)


def before_assistant(messages: list[dict], number: int) -> int | None:
    """The index of the `number`-th (from 1) assistant message in `messages`: the length of the
    conversation before it. None when `messages` holds fewer assistant messages."""
    seen = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            seen += 1
            if seen == number:
                return i
    return None
