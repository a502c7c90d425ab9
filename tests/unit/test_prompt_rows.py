"""One prompt-row contract (eyrie.data.prompts, issue 52 item 2): every accepted shape read the same by
generate (its start check and its requests), `eyrie run --plan` (its request count and mean length) and
verify's benchmark files; a shape none accepts refused by all three with the same fix (at 40c2bde the
benchmarks took `prompt`/`question` rows that generate refused, and --plan fell back in silence)."""

from __future__ import annotations

import json

import pytest

from eyrie.core.errors import EyrieError
from eyrie.data import dataset
from eyrie.data.prompts import ROW_FIX, SHAPES, to_prompt, to_turns
from eyrie.runs.plan_inputs import _prompt_and_answer, dataset_rows, requests
from eyrie.stages.run_config import RunConfig
from eyrie.stages.start_checks import usable_row
from eyrie_trainer.benchmarks import load_benchmark

USER = [{"role": "user", "content": "Name a colour."}]
ACCEPTED = {  # each shape SHAPES names, and the conversation it reads as
    "conversations": ({"conversations": [{"from": "human", "value": "Name a colour."}]}, USER, []),
    "messages": ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
                 [{"role": "system", "content": "Be brief."}, *USER], []),
    "prompt": ({"prompt": "Name a colour."}, USER, []),
    "question": ({"question": "Name a colour."}, USER, []),
    "instruction": ({"instruction": "Name a colour.", "input": "Warm ones."},
                    [{"role": "user", "content": "Name a colour.\n\nWarm ones."}], []),
    "turns": ({"turns": ["Name a colour.", "And another?"]}, USER, ["And another?"]),
}
UNKNOWN = {"text": "Name a colour."}


def written(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def config(source: str) -> RunConfig:
    return RunConfig.model_validate({"run": "rows", "target": {"model": "m"}, "dataset": {"source": source}})


def test_every_shape_is_named_here():
    assert set(ACCEPTED) == {name for name, _ in SHAPES}


@pytest.mark.parametrize("shape", list(ACCEPTED))
def test_generate_plan_and_verify_read_each_shape_as_the_same_rows(tmp_path, shape):
    row, conversation, later = ACCEPTED[shape]
    source = written(tmp_path, [row])
    # generate: its start check takes the row, and it asks the conversation, then each later turn
    usable_row(dataset.resolve(source))
    assert to_prompt(row) == conversation
    assert to_turns(row, "all") == [conversation] + [[{"role": "user", "content": t}] for t in later]
    # --plan: the same rows, the same requests, the prompt's text
    assert dataset_rows(config(source))[0] == 1
    assert requests(1, dataset.resolve(source), "all")["per_row"] == 1 + len(later)
    assert _prompt_and_answer(row)[0] == "\n".join(m["content"] for m in conversation)
    # verify's benchmark file: the same prompt, the later turn as its second
    bench = load_benchmark(source)
    assert bench.prompts == [conversation] and bench.second_turns == ([later[0]] if later else [])


def test_a_shape_none_accepts_is_refused_by_all_three_with_the_same_fix(tmp_path):
    source = written(tmp_path, [UNKNOWN, UNKNOWN])
    refusals = []
    for read in (lambda: usable_row(dataset.resolve(source)), lambda: dataset_rows(config(source)),
                 lambda: load_benchmark(source)):
        with pytest.raises(EyrieError) as refused:
            read()
        refusals.append(refused.value)
    assert {r.fix for r in refusals} == {ROW_FIX} and all("no_conversation_field" in r.problem for r in refusals)
