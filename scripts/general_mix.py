"""Write assets/prompts/general-mix.jsonl (issue 40): a general training mix of 4,400 prompts (4,000 to train, then
400 that can be held out) in shares close to mlabonne/open-perfectblend's: math 53%, code 19%, chat 19%,
instruction 9%, from the committed raw sets (assets/prompts/README.md says where each comes from and under which
license). Every prefix of the file holds those shares (and, inside a category, each source's share), so its first
1,000 or 2,000 rows are smaller points of a learning curve with the same mix.

Rows are dropped, and counted, when a user turn is empty, when the user turns hold over 6,000 characters together,
when their user turns repeat an earlier row's, and when any user turn equals or near-duplicates a prompt of a verify
set (MT-Bench both turns, GSM8K test, HumanEval): equal after `normalize`, one containing the other where the
shorter has at least 40 characters, or the two sharing a run of 120 normalized characters (a reworded copy: MT-Bench
question 97 is awesome-chatgpt-prompts' "math teacher" prompt reworded, GSM8K train holds a test question with other
names). Deterministic, stdlib only: a rerun writes the same bytes.

    python scripts/general_mix.py
"""

import bisect
import csv
import gzip
import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_sets import GSM8K_TRAIN, PROMPTS, SEED_TASKS, read_jsonl, seed_task_prompt  # noqa: E402

ROOT = PROMPTS.parent.parent
BENCH = ROOT / "services" / "trainer" / "eyrie_trainer" / "benchmarks" / "data"
OUT = PROMPTS / "general-mix.jsonl"
SIZE = 4_400
SHARES = {"math": 53, "code": 19, "chat": 19, "instruction": 9}  # percent of every prefix
MAX_USER_CHARS = 6_000
MIN_CONTAINED = 40
MIN_RUN, RUN_WINDOW, RUN_STEP = 120, 100, 20  # a shared run of MIN_RUN holds a window at a multiple of RUN_STEP
OA_THREADS_PER_TREE = 3
ALL, REST = "all", "rest"
# Per category, its sources in the order their rows are dealt: ALL takes every kept row, REST fills the category.
MIX = {
    "math": [("gsm8k-train", REST)],
    "code": [("gpteacher-codegen", REST)],
    "chat": [("open-assistant-tree", ALL), ("open-assistant-lottery", ALL),
             ("awesome-chatgpt-prompts-prompts", ALL), ("gpteacher-roleplay", REST)],
    "instruction": [("self-instruct-seed", ALL), ("self-instruct-user", REST)],
}


def normalize(text: str) -> str:
    """Lowercase, every run of non-alphanumerics to one space, trimmed."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def row(source: str, split: str, index: int, category: str, turns: list[str]) -> dict:
    roles = ("user", "assistant")
    return {"id": f"{source}-{split}-{index:05d}", "source": source, "category": category,
            "conversations": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def instruction_prompt(instruction: str, given: str) -> str:
    return f"{instruction}\n\n{given}" if given.strip() else instruction


def oa_threads(tree: dict) -> list[list[str]]:
    """Up to OA_THREADS_PER_TREE conversations from one OpenAssistant message tree, human-written user turns only:
    one per follow-up question (assistant replies taken best rank first, follow-ups in file order), each continued
    along its best-ranked assistant reply and first human follow-up to a leaf; a tree with no follow-up gives its
    first question alone."""
    def best(replies):
        ranked = sorted(enumerate(replies), key=lambda p: (p[1].get("rank") is None, p[1].get("rank") or 0, p[0]))
        return [r for _, r in ranked if not r.get("deleted")]

    def human(replies):
        return [r for r in replies if not r.get("synthetic") and not r.get("deleted") and r["text"].strip()]

    def extend(path, message):  # message is a user turn: add its best answer, then that answer's first follow-up
        path = path + [message["text"]]
        answers = best(message["replies"])
        if answers:
            path.append(answers[0]["text"])
            follow = human(answers[0]["replies"])
            if follow:
                return extend(path, follow[0])
        return path

    root = tree["prompt"]
    if root.get("synthetic") or root.get("deleted"):
        return []
    pairs = [(a, q) for a in best(root["replies"]) for q in human(a["replies"])][:OA_THREADS_PER_TREE]
    if not pairs:
        return [[root["text"]]]
    return [extend([root["text"], a["text"]], q) for a, q in pairs]


def candidates() -> dict[str, list[dict]]:
    """Every row each source could give, keyed "<source>-<split>", in file order."""
    def gpteacher(name, split, category):
        tasks = json.loads((PROMPTS / "gpteacher" / name).read_text(encoding="utf-8"))
        return [row("gpteacher", split, i, category, [instruction_prompt(t["instruction"], t.get("input", ""))])
                for i, t in enumerate(tasks)]

    trees = read_jsonl(PROMPTS / "open-assistant" / "en_100_tree.jsonl")
    lottery = read_jsonl(PROMPTS / "open-assistant" / "prompt_lottery_en_250_text.jsonl")
    with (PROMPTS / "awesome-chatgpt-prompts" / "prompts.csv").open(encoding="utf-8", newline="") as f:
        acts = list(csv.DictReader(f))
    users = read_jsonl(PROMPTS / "self-instruct" / "user_oriented_instructions.jsonl")
    return {
        "gsm8k-train": [row("gsm8k", "train", i, "math", [r["question"]])
                        for i, r in enumerate(read_jsonl(GSM8K_TRAIN))],
        "gpteacher-codegen": gpteacher("codegen-instruct.json", "codegen", "code"),
        "open-assistant-tree": [row("open-assistant", "tree", t * 10 + j, "chat", turns)
                                for t, tree in enumerate(trees) for j, turns in enumerate(oa_threads(tree))],
        "open-assistant-lottery": [row("open-assistant", "lottery", i, "chat", [p]) for i, p in enumerate(lottery)],
        "awesome-chatgpt-prompts-prompts": [row("awesome-chatgpt-prompts", "prompts", i, "chat", [a["prompt"]])
                                            for i, a in enumerate(acts)],
        "gpteacher-roleplay": gpteacher("roleplay-simple-deduped-roleplay-instruct.json", "roleplay", "chat"),
        "self-instruct-seed": [row("self-instruct", "seed", i, "instruction", [seed_task_prompt(t)])
                               for i, t in enumerate(read_jsonl(SEED_TASKS))],
        "self-instruct-user": [row("self-instruct", "user", i, "instruction", [seed_task_prompt(t)])
                               for i, t in enumerate(users)],
    }


def user_turns(r: dict) -> list[str]:
    return [t["content"] for t in r["conversations"] if t["role"] == "user"]


class VerifySets:
    """The verify sets' prompts, normalized: `flags(texts)` names, for each text, the set it equals or
    near-duplicates (None where it does not). Fast: a set lookup, then one substring search of each text in all
    verify prompts joined, and of each verify prompt in all the texts joined ("\\0" never occurs in normalized
    text, so no match spans two of them), then a lookup of every window of each verify prompt among the texts'
    windows (a shared run of 119 characters or more always holds one; some shorter ones from 100 do)."""

    def __init__(self, prompts: dict[str, list[str]]):
        self.exact, self.owner, parts, self.starts = {}, [], [], []
        offset = 0
        for name, texts in prompts.items():
            for norm in map(normalize, texts):
                self.exact.setdefault(norm, name)
                self.starts.append(offset)
                self.owner.append(name)
                parts.append(norm)
                offset += len(norm) + 1
        self.parts, self.joined = parts, "\0".join(parts)
        self.long = [(p, n) for p, n in zip(parts, self.owner) if len(p) >= MIN_CONTAINED]

    @classmethod
    def load(cls) -> "VerifySets":
        mt_bench = [turn for q in read_jsonl(BENCH / "mt-bench" / "question.jsonl") for turn in q["turns"]]
        gsm8k = [q["question"] for q in read_jsonl(BENCH / "gsm8k" / "test.jsonl")]
        with gzip.open(BENCH / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            humaneval = [json.loads(line)["prompt"] for line in f if line.strip()]
        return cls({"mt-bench": mt_bench, "gsm8k-test": gsm8k, "humaneval": humaneval})

    def flags(self, texts: list[str]) -> list[str | None]:
        norms = [normalize(t) for t in texts]
        found: list[str | None] = [self.exact.get(n) for n in norms]
        for i, n in enumerate(norms):
            if found[i] is None and len(n) >= MIN_CONTAINED and (at := self.joined.find(n)) >= 0:
                found[i] = self.owner[bisect.bisect_right(self.starts, at) - 1]
        joined, starts, offset = "\0".join(norms), [], 0
        for n in norms:
            starts.append(offset)
            offset += len(n) + 1
        for v, name in self.long:
            at = joined.find(v)
            while at >= 0:
                i = bisect.bisect_right(starts, at) - 1
                found[i] = found[i] or name
                at = joined.find(v, at + 1)
        windows = {}  # every RUN_STEP-th window of RUN_WINDOW characters of each text: catches shared runs >= MIN_RUN
        for i, n in enumerate(norms):
            for at in range(0, len(n) - RUN_WINDOW + 1, RUN_STEP):
                windows.setdefault(n[at:at + RUN_WINDOW], []).append(i)
        for v, name in zip(self.parts, self.owner):
            for at in range(len(v) - RUN_WINDOW + 1):
                for i in windows.get(v[at:at + RUN_WINDOW], ()):
                    found[i] = found[i] or name
        return found


def kept(pool: dict[str, list[dict]], verify: VerifySets) -> tuple[dict[str, list[dict]], Counter]:
    """The rows that pass the drops, each source in a fixed pseudo-random order (sha256 of the id)."""
    drops, seen, out = Counter(), set(), {}
    for key, rows in pool.items():
        texts = [t for r in rows for t in user_turns(r)]
        flags = iter(verify.flags(texts))
        out[key] = []
        for r in rows:
            turns = user_turns(r)
            overlap = next((f for f in [next(flags) for _ in turns] if f), None)
            signature = "\n".join(normalize(t) for t in turns)
            reason = ("empty user turn" if not all(t.strip() for t in turns) else
                      f"over {MAX_USER_CHARS:,} user characters" if sum(map(len, turns)) > MAX_USER_CHARS else
                      f"overlaps {overlap}" if overlap else "repeats an earlier row" if signature in seen else None)
            if reason:
                drops[(key, reason)] += 1
                continue
            seen.add(signature)
            out[key].append(r)
        out[key].sort(key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
    return out, drops


def deal(counts: dict[str, int]) -> list[str]:
    """Keys in an order whose every prefix holds each key's share of the total, within one row: each step takes the
    key furthest behind its share (integer arithmetic; ties to the first key)."""
    total, taken, order = sum(counts.values()), dict.fromkeys(counts, 0), []
    for i in range(1, total + 1):
        key = max(counts, key=lambda k: counts[k] * i - taken[k] * total)
        taken[key] += 1
        order.append(key)
    return order


def general_mix() -> tuple[list[dict], Counter]:
    rows, drops = kept(candidates(), VerifySets.load())
    sizes = {c: SIZE * share // 100 for c, share in SHARES.items()}
    if sum(sizes.values()) != SIZE:
        raise SystemExit(f"shares {SHARES} do not split {SIZE} rows evenly")
    streams = {}
    for category, sources in MIX.items():
        counts = {key: len(rows[key]) for key, take in sources if take == ALL}
        rest = [key for key, take in sources if take == REST]
        counts.update({key: sizes[category] - sum(counts.values()) for key in rest})
        short = {key: (n, len(rows[key])) for key, n in counts.items() if not 0 <= n <= len(rows[key])}
        if short:
            raise SystemExit(f"{category}: too few rows (wanted, kept) {short}")
        sources_iter = {key: iter(rows[key]) for key in counts}
        streams[category] = iter([next(sources_iter[key]) for key in deal(counts)])
    return [next(streams[c]) for c in deal(sizes)], drops


def write(rows: list[dict], out: Path) -> None:
    with out.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    mix, dropped = general_mix()
    write(mix, OUT)
    for (key, reason), n in sorted(dropped.items()):
        print(f"dropped {n} {key} rows: {reason}")
    print("rows per source:", dict(sorted(Counter(r["id"].rsplit("-", 1)[0] for r in mix).items())))
    turns = Counter(len(r["conversations"]) for r in mix if len(user_turns(r)) > 1)
    print(f"{sum(turns.values())} multi-turn rows, by number of turns: {dict(sorted(turns.items()))}")
    print(f"{len(mix)} prompts in {OUT}")
