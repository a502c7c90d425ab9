"""A dataset row to the chat requests the target answers, or the reason it can't be one: the prompt
row contract, one for every reader (generate's planner and its shards, `--plan`, verify's benchmark
files). Every accepted shape (SHAPES) reads into one canonical row: a conversation of role/content
messages, and the later user turns a `turns` row asks after the target's own answers."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
}
# what every refusal of a row's shape says it could be (one text: generate, --plan and verify alike)
ROW_SHAPES = ("`conversations` or `messages` (a list of turns: {from, value} or {role, content}) with a human/user "
              "turn, or a `prompt`, `question`, `instruction` (with an optional `input`) text, or `turns` (a list of "
              "user texts, each asked after the answer to the one before)")
ROW_FIX = (f"give rows with {ROW_SHAPES}, one JSON object per line for .jsonl (convert a JSON array or CSV to "
           "JSON Lines).")


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Row:
    """A row read: its conversation (role/content), and user turns asked after the target's own answers."""

    conversation: list[dict]
    later_turns: list[str] = field(default_factory=list)


def to_row(row) -> Row | Skip:
    """The row in its canonical shape, by the first of SHAPES' fields it sets (a null field counts as
    absent: parquet and HF datasets give every row every column, and every turn every key)."""
    if not isinstance(row, dict):
        return Skip("row_not_an_object")
    for name, read in SHAPES:
        if row.get(name) is not None:
            return read(row, name)
    return Skip("no_conversation_field")


def _turn_list(row: dict, name: str) -> Row | Skip:
    """`conversations`/`messages`: ShareGPT's from/value (mlabonne/open-perfectblend) or OpenAI's role/content."""
    turns = row[name]
    if problem := _not_a_list(turns):
        return problem
    messages = []
    for turn in turns:
        message = _to_message(turn)
        if isinstance(message, Skip):
            return message
        messages.append(message)
    return Row(messages)


def _not_a_list(turns) -> Skip | None:
    if not isinstance(turns, list):
        return Skip("conversation_not_a_list")
    return None if turns else Skip("empty_conversation")


def _text(row: dict, name: str) -> Row | Skip:
    """`prompt`, `question`: one user turn (GSM8K's, HumanEval's)."""
    text = row[name]
    return Row([{"role": "user", "content": text}]) if isinstance(text, str) else Skip("text_not_a_string")


def _instruction(row: dict, name: str) -> Row | Skip:
    """`instruction` and an optional `input` (Alpaca's, self-instruct's): one user turn, the input below."""
    instruction, extra = row[name], row.get("input")
    if not isinstance(instruction, str) or not isinstance(extra, (str, type(None))):
        return Skip("text_not_a_string")
    return Row([{"role": "user", "content": instruction + (f"\n\n{extra}" if extra and extra.strip() else "")}])


def _user_turns(row: dict, name: str) -> Row | Skip:
    """`turns`: user texts (MT-Bench's), the first the prompt, each later one asked after the answer before it."""
    turns = row[name]
    if problem := _not_a_list(turns):
        return problem
    if not all(isinstance(turn, str) for turn in turns):
        return Skip("text_not_a_string")
    return Row([{"role": "user", "content": turns[0]}], list(turns[1:]))


# the accepted shapes, in the order a row's fields are looked at: a shape is added here alone
SHAPES = (("conversations", _turn_list), ("messages", _turn_list), ("prompt", _text), ("question", _text),
          ("instruction", _instruction), ("turns", _user_turns))


def to_prompt(row) -> list[dict] | Skip:
    """Messages up to and including the last human turn, system turns kept."""
    read = to_row(row)
    if isinstance(read, Skip):
        return read
    messages = read.conversation
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
    later = to_row(row).later_turns
    if any(not turn.strip() for turn in later):
        return Skip("empty_prompt")
    asked = _requests(prompt)
    return asked if isinstance(asked, Skip) else asked + [[{"role": "user", "content": turn}] for turn in later]


def _requests(prompt: list[dict]) -> list[list[dict]] | Skip:
    """One request per user turn the conversation has an answer to (or that ends it), carrying the system
    and user messages since the last one."""
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
