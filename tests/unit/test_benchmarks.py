"""Benchmark prompt sets (eyrie_trainer.benchmarks) and the committed training mix (assets/prompts)."""

import json

import pytest

from eyrie.commands.cli_options import checked
from eyrie.core.errors import EyrieError
from eyrie.core.run_config import VerifySection
from eyrie.data import dataset
from eyrie.data.prompts import Skip, to_prompt
from eyrie_trainer.benchmarks import BENCHMARKS, load_benchmark
from tests.support.harness import ROOT

TRAIN_MIX = ROOT / "assets" / "prompts" / "train-mix.jsonl"


@pytest.mark.parametrize("name,rows", [("mt-bench", 80), ("gsm8k", 1319), ("humaneval", 164)])
def test_named_sets_load_every_row_as_one_user_message(name, rows):
    bench = load_benchmark(name)
    assert bench.name == name and len(bench.prompts) == rows
    assert all(len(p) == 1 and p[0]["role"] == "user" and p[0]["content"].strip() for p in bench.prompts)


def test_named_sets_and_their_licenses_ship_in_the_package():
    data = ROOT / "services" / "trainer" / "eyrie_trainer" / "benchmarks" / "data"
    assert all((data / name / "LICENSE").is_file() for name in BENCHMARKS)
    assert '"eyrie_trainer.benchmarks" = ["data/*/*"]' in (ROOT / "pyproject.toml").read_text()


def test_prompts_are_what_each_set_asks():
    mt_bench = load_benchmark("mt-bench", limit=1).prompts[0][0]["content"]
    assert mt_bench.startswith("Compose an engaging travel blog post") and "Rewrite" not in mt_bench
    assert load_benchmark("gsm8k", limit=1).prompts[0][0]["content"].startswith("Janet’s ducks lay 16 eggs")
    humaneval = load_benchmark("humaneval", limit=1).prompts[0][0]["content"]
    assert humaneval.startswith("Complete the following Python function.\n\n```python\nfrom typing import List")
    assert humaneval.endswith("\n```")


def test_mt_bench_carries_each_questions_second_turn_and_the_other_sets_none():
    rows = [json.loads(line) for line in (ROOT / "services" / "trainer" / "eyrie_trainer" / "benchmarks" / "data" /
                                           "mt-bench" / "question.jsonl").read_text().splitlines()]
    bench = load_benchmark("mt-bench")
    assert [p[0]["content"] for p in bench.prompts] == [r["turns"][0] for r in rows]  # the first turns, as before
    assert bench.second_turns == [r["turns"][1] for r in rows] and len(bench.second_turns) == 80
    assert bench.second_turns[0].startswith("Rewrite your previous response. Start every sentence with the letter A.")
    assert load_benchmark("mt-bench", limit=3).second_turns == bench.second_turns[:3]
    assert load_benchmark("gsm8k", limit=3).second_turns == [] and load_benchmark("humaneval", limit=3).second_turns == []


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
    assert bench.second_turns == [None, None, None, None, "h"]  # a row's second `turns` entry: its second turn
    assert load_benchmark(str(path), limit=2).second_turns == []  # none in those rows: a set without second turns


def test_unknown_name_says_what_is_accepted():
    with pytest.raises(EyrieError) as caught:
        load_benchmark("mmlu")
    assert "mt-bench, gsm8k, humaneval" in caught.value.fix and ".jsonl" in caught.value.fix


@pytest.mark.parametrize("text,problem", [
    ("", "has no rows"), ("\n \n", "has no rows"), ('{"prompt": "a"}\n{oops\n', "line 2: not JSON"),
    ('{"answer": "a"}\n', "line 1: not a usable prompt"), ('["a"]\n', "line 1: not a usable prompt"),
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


def test_the_learning_curves_prompt_sets_nest_and_hold_their_self_instruct_share():
    rows = {n: TRAIN_MIX.with_name(f"train-mix-{n}.jsonl").read_text(encoding="utf-8").splitlines() for n in ("1k", "2k", "2200")}
    assert rows["2k"][:1000] == rows["1k"]  # the 2,000-prompt point holds the 1,000-prompt point's prompts
    assert rows["2200"][:2000] == rows["2k"]  # and 200 more GSM8K questions make 2,000 trained with 200 held out
    assert {json.loads(r)["source"] for r in rows["2200"][2000:]} == {"gsm8k"} and len(set(rows["2200"])) == 2200
    sources = [json.loads(line)["source"] for line in rows["2k"]]
    assert (sources.count("gsm8k"), sources.count("self-instruct"), len({json.loads(r)["id"] for r in rows["2k"]})) == (1829, 171, 2000)
    assert sources[9] == sources[999] == sources[1013] == "self-instruct" and sources[1012] == "gsm8k"


# --- bench/storage_modes.py's pure parts (bench/storage_report.py), without a process --------------

def _storage_modes():
    import storage_report

    return storage_report


def _mode(stored: int, peak: int, wall: float, length: float, error: float, requests: int = 0) -> dict:
    return {"stored_bytes": stored, "peak_bytes": peak, "peak_state_bytes": peak // 2, "service_requests": requests,
            "expected_requests": requests, "wall_per_epoch_s": wall, "eyrie_tau": length,
            "acceptance": {"length": length, "error": error}}


def _storage_result() -> dict:
    machine = {"cpus": 2, "cpu": "AMD EPYC", "memory_gib": 23.5, "gpu": None}
    return {"targets": {"tiny": {
        "model": "assets/tiny-target", "machine": machine, "date": "2026-12-03 02:00 UTC", "commit": "abc",
        "vllm": "0.32.0", "command": "python bench/storage_modes.py --target tiny", "prompts": 96, "max_tokens": 64,
        "generate_s": 40.0, "heldout": 8, "epochs": 2, "lr": 0.003, "seq_len": 256, "draft_vocab": 500, "k": 3,
        "device": "cpu", "verify_prompts": 8, "verify_tokens": 64,
        "modes": {"offline": _mode(4_000_000, 9_000_000, 10.0, 1.50, 0.05),
                  "hybrid": _mode(2_000_000, 7_000_000, 12.0, 1.52, 0.05, 100),
                  "online": _mode(40_000, 5_000_000, 14.0, 1.80, 0.05, 180)}}}}


def test_storage_modes_prompt_slice_takes_every_stride_th_row():
    sm = _storage_modes()
    lines = [f"{i}\n" for i in range(30)] + ["\n"]
    assert sm.prompt_slice(lines, 3, 12) == ["0\n", "12\n", "24\n"]
    assert sm.prompt_slice(lines, 2, 1) == ["0\n", "1\n"]
    with pytest.raises(SystemExit, match="fewer than 4 prompts"):
        sm.prompt_slice(lines, 4, 12)


def test_storage_modes_epoch_walls_and_expected_requests():
    sm = _storage_modes()
    walls = sm.epoch_walls(100.0, {"1": 130.0, "0": 110.0}, 131.0, 2)
    assert walls == {"per_epoch_s": [10.0, 20.0], "wall_per_epoch_s": 15.5}
    assert sm.epoch_walls(None, {}, None, 2) == {"per_epoch_s": [], "wall_per_epoch_s": None}
    samples = [{"sample_id": "a"}, {"sample_id": "b", "states": False}, {"sample_id": "c", "states": False},
               {"sample_id": "d", "states": True}]
    assert sm.expected_requests(samples, {"c", "d"}, 3) == 3 + 1  # b every epoch, held-out c once
    assert sm.request_wait({"wall_per_epoch_s": 12.0, "per_epoch_s": [11, 13], "service_requests": 40},
                           {"wall_per_epoch_s": 2.0}) == pytest.approx(0.5)
    assert sm.request_wait({"wall_per_epoch_s": 12.0, "per_epoch_s": [], "service_requests": 40}, {}) is None


def test_storage_modes_acceptance_error_and_noise():
    sm = _storage_modes()
    # every draft accepts exactly one token: no spread
    assert sm.acceptance_error(2.0, [1.0, 0.0, 0.0], 100) == 0.0
    # a in {0, 3} half each: mean 1.5, variance 2.25
    assert sm.acceptance_error(2.5, [0.5, 0.5, 0.5], 100) == pytest.approx(0.15)
    assert sm.acceptance_error(None, [], 0) is None
    assert sm.same_within_noise({"length": 1.5, "error": 0.05}, {"length": 1.6, "error": 0.05})
    assert not sm.same_within_noise({"length": 1.5, "error": 0.05}, {"length": 1.8, "error": 0.05})
    assert sm.same_within_noise({"length": 1.5, "error": None}, {"length": 1.5, "error": 0.1}) is None


def test_storage_modes_section_and_chart():
    import xml.etree.ElementTree as ET

    sm = _storage_modes()
    lines = sm.section(_storage_result(), "results/storage_modes.svg")
    assert lines[0] == "# Storage modes: offline, hybrid, online (bench/storage_modes.py)"
    assert "| tiny | hybrid | 2.00 MB | 7.00 MB | 3.50 MB | 100 (100) | 12.0 s | 1.520 ± 0.050 | 1.520 | - |" in lines
    assert "| tiny | hybrid / offline | 0.50x | 0.78x | 1.20x | 1.01x | yes |" in lines
    assert "| tiny | online / offline | 0.01x | 0.56x | 1.40x | 1.20x | no |" in lines
    assert "![acceptance, wall time per epoch and peak bytes per mode](results/storage_modes.svg)" in lines
    assert any("a mode differs from offline beyond noise" in line for line in lines)
    r = _storage_result()
    r["targets"]["tiny"]["earlier"] = [sm.summary(r["targets"]["tiny"] | {"command": "python bench/storage_modes.py "
                                                                             "--target tiny --prompts 48"})]
    assert ("- earlier run of **tiny** (`python bench/storage_modes.py --target tiny --prompts 48`, "
            "2026-12-03 02:00 UTC, `abc`): wall per epoch offline 10.0 s, hybrid 12.0 s, online 14.0 s; "
            "load average offline -, hybrid -, online -; vLLM acceptance offline 1.500, hybrid 1.520, "
            "online 1.800.") in sm.section(r)
    root = ET.fromstring(sm.chart(_storage_result()))
    assert len(root.findall("{http://www.w3.org/2000/svg}rect")) == 3 + 4 * 3  # legend + 4 panels x 3 modes
