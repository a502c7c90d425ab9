"""assets/prompts/general-mix.jsonl (scripts/general_mix.py): each raw set's license beside it, the README's sha256
list, no verify-set prompt (nor a near-duplicate of one) in the mix, the stated shares in every prefix, eyrie's row
contract, multi-turn rows. Reads files only: the unit tier."""

import hashlib
import importlib.util
import json
import re
from collections import Counter

import pytest

from eyrie.data.prompts import to_prompt
from tests.support.harness import ROOT

PROMPTS = ROOT / "assets" / "prompts"
README = (PROMPTS / "README.md").read_text(encoding="utf-8")
MIX = PROMPTS / "general-mix.jsonl"

_spec = importlib.util.spec_from_file_location("general_mix", ROOT / "scripts" / "general_mix.py")
gm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gm)

LINES = MIX.read_text(encoding="utf-8").splitlines()
ROWS = [json.loads(line) for line in LINES]


def user_turns(row: dict) -> list[str]:
    return [t["content"] for t in row["conversations"] if t["role"] == "user"]


def overlapping(rows: list[dict], verify) -> list[str]:
    """Ids of the rows with a user turn equal to, or a near-duplicate of, a verify-set prompt."""
    turns = [(r["id"], t) for r in rows for t in user_turns(r)]
    flags = verify.flags([t for _, t in turns])
    return sorted({rid for (rid, _), flag in zip(turns, flags) if flag})


@pytest.fixture(scope="module")
def verify():
    return gm.VerifySets.load()


def test_every_source_folder_has_its_license():
    folders = [d for d in PROMPTS.iterdir() if d.is_dir()]
    names = {"gsm8k", "self-instruct", "open-assistant", "gpteacher", "awesome-chatgpt-prompts"}
    assert {d.name for d in folders} >= names
    assert all((d / "LICENSE").is_file() and (d / "LICENSE").stat().st_size > 100 for d in folders)


def test_readme_sha256_lines_are_the_files():
    listed = dict((path, digest) for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", README, re.M))
    for path, digest in listed.items():
        file = PROMPTS / path if (PROMPTS / path).exists() else ROOT / path
        assert hashlib.sha256(file.read_bytes()).hexdigest() == digest, path
    data = {str(p.relative_to(PROMPTS)) for p in PROMPTS.rglob("*")
            if p.is_file() and p.name not in ("README.md", "LICENSE")}
    assert data <= listed.keys(), f"not in the README's sha256 list: {sorted(data - listed.keys())}"


def test_the_mix_holds_no_verify_prompt_nor_a_near_duplicate(verify):
    sizes = {"mt-bench": 160, "gsm8k-test": 1319, "humaneval": 164}  # MT-Bench: both turns of its 80 questions
    assert Counter(verify.owner) == sizes
    assert overlapping(ROWS, verify) == []


def test_the_check_flags_a_verify_prompt_put_in(verify):
    turns = [t for q in gm.read_jsonl(gm.BENCH / "mt-bench" / "question.jsonl") for t in q["turns"]]
    question, longest = turns[7], max(turns, key=len)
    gsm8k = gm.read_jsonl(gm.BENCH / "gsm8k" / "test.jsonl")[5]["question"]
    texts = {
        "respaced": "  " + question.upper().replace(" ", " \n\t "),  # MT-Bench, other spacing and case
        "inside": f"Please help me with this one: {gsm8k} Thank you!",  # a GSM8K question in a longer prompt
        "part": gsm8k[5:75],  # 70 characters of a GSM8K question
        "reworded": f"Kindly {longest[100:260]} and so on",  # 160 characters of a prompt, neither inside the other
        "reworded again": f"Also: {longest[100:260]}!",  # the same run in a second text
        "short": question[:30],  # under 40 characters: no near-duplicate
        "other": "Write a haiku about the sea at dawn.",
    }
    assert dict(zip(texts, verify.flags(list(texts.values())))) == {
        "respaced": "mt-bench", "inside": "gsm8k-test", "part": "gsm8k-test", "reworded": "mt-bench",
        "reworded again": "mt-bench", "short": None, "other": None}
    planted = {"id": "planted-x-00000", "source": "planted", "category": "chat", "conversations": [
        {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": texts["respaced"]}]}
    assert overlapping(ROWS[:100] + [planted], verify) == ["planted-x-00000"]


@pytest.mark.parametrize("n", [1000, 2000, 4000, len(ROWS)])
def test_every_prefix_holds_the_stated_shares(n):
    counts = Counter(r["category"] for r in ROWS[:n])
    assert counts.keys() == gm.SHARES.keys()
    assert all(abs(100 * counts[c] / n - share) <= 2 for c, share in gm.SHARES.items()), counts


def test_the_readme_states_the_shares_and_rows():
    counts = Counter(r["category"] for r in ROWS)
    assert len(ROWS) == gm.SIZE == 4_400
    for category, share in gm.SHARES.items():
        line = next(line for line in README.splitlines() if line.startswith(f"| {category} |"))
        assert f"{share}% ({counts[category]:,} rows)" in line, line


def test_every_row_is_a_prompt_by_eyries_row_contract():
    assert all(line.isascii() and json.dumps(row) == line for line, row in zip(LINES, ROWS))
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    for row in ROWS:
        assert list(row) == ["id", "source", "category", "conversations"]
        assert re.fullmatch(rf"{re.escape(row['source'])}-[a-z]+-\d{{5}}", row["id"]), row["id"]
        assert row["category"] in gm.SHARES
        prompt = to_prompt(row)
        assert isinstance(prompt, list) and prompt[-1]["role"] == "user", (row["id"], prompt)
        assert all(t.strip() for t in user_turns(row)) and sum(map(len, user_turns(row))) <= gm.MAX_USER_CHARS


def test_multi_turn_rows_alternate_user_and_assistant_and_the_readme_counts_them():
    multi = [r for r in ROWS if len(user_turns(r)) > 1]
    single = [r for r in ROWS if len(user_turns(r)) == 1]
    assert len(multi) + len(single) == len(ROWS)
    assert all(len(r["conversations"]) == 1 for r in single)
    assert all([t["role"] for t in r["conversations"]] == ["user", "assistant"] * (len(r["conversations"]) // 2)
               + ["user"] * (len(r["conversations"]) % 2) for r in multi)
    assert all(t["content"].strip() for r in multi for t in r["conversations"])
    stated = re.search(r"(\d[\d,]*) multi-turn rows", README)
    assert stated and int(stated.group(1).replace(",", "")) == len(multi) > 200
    assert sum(len(user_turns(r)) > 1 for r in ROWS[:1000]) >= len(multi) * 1000 // len(ROWS) - 5


def test_a_rerun_writes_the_same_bytes():
    mix, _ = gm.general_mix()
    assert "".join(json.dumps(r) + "\n" for r in mix) == MIX.read_text(encoding="utf-8")
