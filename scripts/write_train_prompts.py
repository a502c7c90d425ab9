"""Write tests/data/tiny_train_prompts.jsonl: every distinct prompt the tiny target was trained on
(its greedy answers are known), ShareGPT rows, shuffled. The corpus `make demo` and the train
tests generate from, so a drafter has a predictable corpus of a few hundred samples to learn."""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from build_tiny_target import SEED, all_tasks  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_train_prompts.jsonl"

if __name__ == "__main__":
    prompts = [prompt for _, prompt, _, _ in all_tasks()]
    random.Random(SEED).shuffle(prompts)
    OUT.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": p}]}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts in {OUT}")
