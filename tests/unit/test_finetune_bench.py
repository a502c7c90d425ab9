"""bench/finetune.py's pure parts, without a process: each row's category read from the dataset the run names
(relative to the repository, as the bench configs give it), and the RESULTS.md section (a row per point, its
optimizer steps and vLLM's acceptance per set)."""

import json
from types import SimpleNamespace

from tests.support.harness import ROOT

import finetune


def test_categories_are_the_mix_rows_own_field_by_row_number():
    manifest = SimpleNamespace(dataset=SimpleNamespace(source="assets/prompts/general-mix.jsonl"))
    of_row = finetune.categories(manifest)
    rows = (ROOT / "assets/prompts/general-mix.jsonl").read_text().splitlines()
    assert len(of_row) == len(rows) and set(of_row.values()) == {"math", "code", "chat", "instruction"}
    assert of_row[17] == json.loads(rows[17])["category"]


def test_the_section_has_a_row_per_point_with_its_steps_and_acceptance_per_set():
    def point(label, steps, tau):
        return {"label": label, "prompts": 1000, "steps": steps, "train_s": 600.0, "eyrie_tau": tau,
                "sets": {"heldout": {"vllm_acceptance_length": tau}, "gsm8k": {"vllm_acceptance_length": tau + 0.2}}}

    r = {"run": "r", "size": 1000, "base_category": "math", "command": "python bench/finetune.py --run r --size 1k",
         "machine": {"cpu": "AMD EPYC", "cpus": 2}, "date": "2026-12-06 01:00 UTC", "commit": "abc1234", "k": 3,
         "prompts": 40, "max_tokens": 256,
         "points": [point("1000", 800, 2.1), point("base: 530 math", 400, 1.9),
                    point("finetuned from the base, 800 steps", 800, 2.2),
                    point("finetuned from the base, 400 steps", 400, 2.12)]}
    lines = finetune.section(r)
    assert lines[0].startswith("# Finetuning from a base drafter: r, slice 1000, base on its math rows")
    rows = [line for line in lines if line.startswith("| finetuned")]
    assert rows == ["| finetuned from the base, 800 steps | 1000 | 800 | 10.0 | 2.20 | 2.20 | 2.40 |",
                    "| finetuned from the base, 400 steps | 1000 | 400 | 10.0 | 2.12 | 2.12 | 2.32 |"]
    assert lines[-1].endswith("heldout +0.02, gsm8k +0.02. Goal (within 0.05 of from scratch on every set): holds.")
    r["points"][-1]["sets"]["gsm8k"]["vllm_acceptance_length"] = 2.24
    assert finetune.section(r)[-1].endswith("gsm8k -0.06. Goal (within 0.05 of from scratch on every set): does not hold.")


def test_budgets_are_shares_of_the_scratch_points_steps_half_last():
    a = finetune.parse_args(["--run", "r", "--size", "1k", "--budgets", "0.5"])
    assert (a.size, a.budgets) == (1000, [0.5])
    assert finetune.parse_args(["--run", "r", "--size", "1000"]).budgets == [1.0, 0.5]
