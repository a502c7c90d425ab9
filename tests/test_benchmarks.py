"""Benchmark prompt sets (eyrie.benchmarks) and the committed training mix (assets/prompts)."""

import json
from pathlib import Path

import pytest

from eyrie.benchmarks import BENCHMARKS, load_benchmark
from eyrie.commands.cli_options import checked
from eyrie.core.errors import EyrieError
from eyrie.data import dataset
from eyrie.runs.pipeline import VerifySection
from eyrie_generator.prompts import Skip, to_prompt

ROOT = Path(__file__).resolve().parent.parent
TRAIN_MIX = ROOT / "assets" / "prompts" / "train-mix.jsonl"


@pytest.mark.parametrize("name,rows", [("mt-bench", 80), ("gsm8k", 1319), ("humaneval", 164)])
def test_named_sets_load_every_row_as_one_user_message(name, rows):
    bench = load_benchmark(name)
    assert bench.name == name and len(bench.prompts) == rows
    assert all(len(p) == 1 and p[0]["role"] == "user" and p[0]["content"].strip() for p in bench.prompts)


def test_named_sets_and_their_licenses_ship_in_the_package():
    data = ROOT / "eyrie" / "benchmarks" / "data"
    assert all((data / name / "LICENSE").is_file() for name in BENCHMARKS)
    assert '"eyrie.benchmarks" = ["data/*/*"]' in (ROOT / "pyproject.toml").read_text()


def test_prompts_are_what_each_set_asks():
    mt_bench = load_benchmark("mt-bench", limit=1).prompts[0][0]["content"]
    assert mt_bench.startswith("Compose an engaging travel blog post") and "Rewrite" not in mt_bench
    assert load_benchmark("gsm8k", limit=1).prompts[0][0]["content"].startswith("Janet’s ducks lay 16 eggs")
    humaneval = load_benchmark("humaneval", limit=1).prompts[0][0]["content"]
    assert humaneval.startswith("Complete the following Python function.\n\n```python\nfrom typing import List")
    assert humaneval.endswith("\n```")


def test_limit_takes_the_first_rows_in_file_order():
    assert load_benchmark("gsm8k", limit=5).prompts == load_benchmark("gsm8k").prompts[:5]
    assert len(load_benchmark("mt-bench", limit=1000).prompts) == 80
    with pytest.raises(EyrieError, match="below 1"):
        load_benchmark("gsm8k", limit=0)


def test_a_local_jsonl_file(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}]},
        {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
        {"prompt": "e"}, {"question": "f"}, {"turns": ["g", "h"]},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    bench = load_benchmark(str(path))
    assert bench.name == "mine"
    assert bench.prompts == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}],
        *([{"role": "user", "content": text}] for text in "cefg"),
    ]
    assert load_benchmark(str(path), limit=2).prompts == bench.prompts[:2]


def test_unknown_name_says_what_is_accepted():
    with pytest.raises(EyrieError) as caught:
        load_benchmark("mmlu")
    assert "mt-bench, gsm8k, humaneval" in caught.value.fix and ".jsonl" in caught.value.fix


@pytest.mark.parametrize("text,problem", [
    ("", "has no rows"), ("\n \n", "has no rows"), ('{"prompt": "a"}\n{oops\n', "line 2: not JSON"),
    ('{"answer": "a"}\n', "line 1: no prompt"), ('["a"]\n', "line 1: no prompt"),
])
def test_an_empty_or_unreadable_file_is_refused_with_a_fix(tmp_path, text, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(EyrieError, match=problem) as caught:
        load_benchmark(str(path))
    assert "jsonl" in caught.value.fix or "prompt" in caught.value.fix


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(EyrieError, match="cannot read") as caught:
        load_benchmark(str(path))
    assert "UTF-8" in caught.value.fix


def test_verify_settings_split_the_sets_and_refuse_a_repeat():
    given = VerifySection(benchmarks=" mt-bench, gsm8k,,humaneval ,", ks="3,5")
    assert given.benchmarks == ["mt-bench", "gsm8k", "humaneval"] and given.ks == [3, 5]
    with pytest.raises(EyrieError, match="--bench .*name each benchmark once"):
        checked(VerifySection, {"benchmarks": "gsm8k,mt-bench, gsm8k"})


def test_train_mix_is_read_as_7648_prompts_by_the_dataset_reader():
    ref = dataset.resolve(str(TRAIN_MIX))
    assert (ref.kind, ref.row_end) == ("jsonl", 7648)
    prompts = [to_prompt(row) if why is None else Skip(why) for _, row, why in dataset.iter_rows(ref)]
    assert len(prompts) == 7648 and not [p for p in prompts if isinstance(p, Skip)]
    rows = [json.loads(line) for line in TRAIN_MIX.read_text(encoding="utf-8").splitlines()]
    assert [r["source"] for r in rows] == ["gsm8k"] * 7473 + ["self-instruct"] * 175
    assert rows[0]["id"] == "gsm8k-train-00000" and rows[-1]["id"] == "self-instruct-seed-00174"
