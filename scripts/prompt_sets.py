"""Write assets/prompts/train-mix.jsonl, the real-model example's training prompts, from the committed raw
sets: GSM8K train questions (7,473) then self-instruct seed tasks (175: the instruction, plus a blank line and
the first instance's input when it has one); and train-mix-1k.jsonl, issue 28's 1,000-prompt point: the first
900 GSM8K questions with the first 100 seed tasks spread through them (every 10th row), so that every prefix
holds a 10% self-instruct share; and train-mix-2k.jsonl, its 2,000-prompt point: train-mix-1k.jsonl, then 929
more GSM8K questions with the other 71 seed tasks as every 14th row (the seed tasks run out at 175), so that its
first 1,000 rows are the 1,000-prompt point's; and train-mix-2200.jsonl, the point with 2,000 trained prompts and
200 held out: train-mix-2k.jsonl, then the next 200 GSM8K questions. Deterministic, stdlib only; assets/prompts/README.md says where each raw file
comes from.

    python scripts/prompt_sets.py
"""

import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "prompts"
GSM8K_TRAIN = PROMPTS / "gsm8k" / "train.jsonl"
SEED_TASKS = PROMPTS / "self-instruct" / "seed_tasks.jsonl"
OUT = PROMPTS / "train-mix.jsonl"
OUT_1K = PROMPTS / "train-mix-1k.jsonl"
OUT_2K = PROMPTS / "train-mix-2k.jsonl"
OUT_2200 = PROMPTS / "train-mix-2200.jsonl"
EXPECTED = {"gsm8k": 7_473, "self-instruct": 175}


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def seed_task_prompt(task: dict) -> str:
    first_input = task["instances"][0]["input"] if task["instances"] else ""
    return f"{task['instruction']}\n\n{first_input}" if first_input.strip() else task["instruction"]


def row(source: str, split: str, index: int, text: str) -> dict:
    return {"id": f"{source}-{split}-{index:05d}", "source": source,
            "conversations": [{"role": "user", "content": text}]}


def train_mix() -> list[dict]:
    gsm8k = [row("gsm8k", "train", i, r["question"]) for i, r in enumerate(read_jsonl(GSM8K_TRAIN))]
    seeds = [row("self-instruct", "seed", i, seed_task_prompt(t)) for i, t in enumerate(read_jsonl(SEED_TASKS))]
    counts = {"gsm8k": len(gsm8k), "self-instruct": len(seeds)}
    if counts != EXPECTED:
        raise SystemExit(f"unexpected row counts {counts}, expected {EXPECTED}: check the raw files")
    return gsm8k + seeds


def spread(rows: list[dict], blocks: list[tuple[int, int]]) -> list[dict]:
    """For each (size, every) in `blocks`, `size` rows: one self-instruct seed task in every `every` (None: none),
    GSM8K questions between them; each source in file order, continued from block to block."""
    gsm8k = iter(r for r in rows if r["source"] == "gsm8k")
    seeds = iter(r for r in rows if r["source"] == "self-instruct")
    return [next(seeds) if every and i % every == every - 1 else next(gsm8k)
            for size, every in blocks for i in range(size)]


def write(rows: list[dict], out: Path) -> None:
    with out.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{len(rows)} prompts in {out}")


if __name__ == "__main__":
    mix = train_mix()
    write(mix, OUT)
    write(spread(mix, [(1000, 10)]), OUT_1K)
    write(spread(mix, [(1000, 10), (1000, 14)]), OUT_2K)
    write(spread(mix, [(1000, 10), (1000, 14), (200, None)]), OUT_2200)
