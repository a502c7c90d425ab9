"""Benchmark prompt sets the verify stage measures a drafter on: named sets shipped here, or a .jsonl file."""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.data.prompts import ROW_FIX, Skip, to_prompt, to_row

BENCHMARKS = ("mt-bench", "gsm8k", "humaneval")
DATA = Path(__file__).parent / "data"
FILES = {"mt-bench": "mt-bench/question.jsonl", "gsm8k": "gsm8k/test.jsonl", "humaneval": "humaneval/HumanEval.jsonl.gz"}
HUMANEVAL = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass
class Benchmark:
    """A prompt set: each question's first-turn messages, and where the set has them its second user turns
    (MT-Bench's, a file's rows with 2+ `turns`; None for a question without one), which verify asks after the
    model's OWN first answer (eyrie_trainer.verify_turns). `second_turns` is empty for a set without any."""

    name: str
    prompts: list[list[dict]]
    second_turns: list[str | None] = field(default_factory=list)


def load_benchmark(name_or_path: str, limit: int | None = None) -> Benchmark:
    """The first `limit` prompts (all when None) of a named set or of a .jsonl file, in file order.

    mt-bench's prompts are the first turn of each question, and its `second_turns` the second: asked after
    the model's own first answer (as FastChat asks it), it is no prompt on its own. gsm8k gives the test
    questions, humaneval asks to complete each function. A file's name is its stem; its rows are read as
    ROW_SHAPES says, a row's second `turns` entry (of 2 or more) being its second turn.
    """
    if limit is not None and limit < 1:
        raise EyrieError(f"benchmark limit {limit} is below 1.", "give a limit of at least 1, or none for all.")
    if name_or_path in BENCHMARKS:
        rows = _rows(DATA / FILES[name_or_path], limit)
        seconds = [row["turns"][1] for _, row in rows] if name_or_path == "mt-bench" else []
        return Benchmark(name_or_path, [[_user_message(name_or_path, row)] for _, row in rows], seconds)
    path = Path(name_or_path).expanduser()
    if path.suffix != ".jsonl" or not path.is_file():
        raise EyrieError(f"unknown benchmark {name_or_path!r}: neither a named set nor an existing .jsonl file.",
                         f"name one of {', '.join(BENCHMARKS)}, or give the path of a .jsonl file of prompts.")
    rows = _rows(path, limit)
    seconds = [_second_turn(row) for _, row in rows]
    return Benchmark(path.stem, [_file_prompt(path, line, row) for line, row in rows],
                     seconds if any(seconds) else [])


def _rows(path: Path, limit: int | None) -> list[tuple[int, object]]:
    """(line number, parsed row) of the first `limit` non-blank lines."""
    try:
        rows = list(itertools.islice(_parsed_lines(path), limit))
    except (OSError, UnicodeDecodeError) as exc:
        raise EyrieError(f"cannot read benchmark file {path}: {exc}.",
                         "give a UTF-8 .jsonl file with one JSON object per line.") from None
    if not rows:
        raise EyrieError(f"benchmark file {path} has no rows.",
                         ROW_FIX)
    return rows


def _parsed_lines(path: Path) -> Iterator[tuple[int, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise EyrieError(f"benchmark file {path}, line {number}: not JSON ({exc.msg}).",
                                     "give a .jsonl file with one JSON object per line.") from None


def _user_message(name: str, row: dict) -> dict:
    if name == "mt-bench":
        return {"role": "user", "content": row["turns"][0]}
    if name == "gsm8k":
        return {"role": "user", "content": row["question"]}
    return {"role": "user", "content": HUMANEVAL.format(prompt=row["prompt"])}


def _file_prompt(path: Path, line: int, row) -> list[dict]:
    if prompt := _row_prompt(row):
        return prompt
    reason = to_prompt(row).reason
    raise EyrieError(f"benchmark file {path}, line {line}: not a usable prompt ({reason}).", ROW_FIX)


def _row_prompt(row) -> list[dict] | None:
    """Messages up to the last user turn (system turns kept), as generate reads a row (eyrie.data.prompts)."""
    prompt = to_prompt(row)
    return None if isinstance(prompt, Skip) else prompt


def _second_turn(row) -> str | None:
    """A row's second user turn, asked after the answer to its first (a `turns` row's: MT-Bench's shape)."""
    read = to_row(row)
    second = read.later_turns[0] if not isinstance(read, Skip) and read.later_turns else None
    return second if second and second.strip() else None
