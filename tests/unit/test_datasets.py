"""Prompt datasets: local JSONL, parquet, HF layout (local directory); rows to prompts."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyrie.core.errors import EyrieError
from eyrie.data import dataset
from eyrie.data.prompts import Skip, to_prompt
from eyrie_generator.plan import sample_id

ROWS = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(25)]


def test_jsonl_rows_and_revision(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ref = dataset.resolve(str(path), limit=10)
    assert (ref.kind, ref.row_start, ref.row_end) == ("jsonl", 0, 10) and len(ref.revision) == 64
    assert [(i, row) for i, row, _ in dataset.iter_rows(ref)] == list(enumerate(ROWS[:10]))
    path.write_text(path.read_text() + "\n")
    assert dataset.resolve(str(path)).revision != ref.revision, "content hash is the revision"


def test_parquet_across_row_groups(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=7)
    ref = dataset.resolve(str(path))
    assert (ref.kind, ref.row_end) == ("parquet", 25)
    ref = ref.model_copy(update={"row_start": 5, "row_end": 16})
    got = list(dataset.iter_rows(ref))
    assert [i for i, _, _ in got] == list(range(5, 16))
    assert all(row == ROWS[i] for i, row, _ in got)


def test_truncated_parquet_is_refused_clearly(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(EyrieError, match="cannot be read.*truncated"):
        dataset.resolve(str(path))


def test_hf_dataset_directory(tmp_path):
    """The Hugging Face loading path (`datasets.load_dataset`), on a local dataset repo layout."""
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "data" / "train-00000-of-00001.parquet")
    ref = dataset.resolve(str(tmp_path), split="train", limit=12)
    assert (ref.kind, ref.row_end) == ("hf", 12)
    rows = list(dataset.iter_rows(ref))
    assert [r for _, r, _ in rows] == ROWS[:12]


def test_missing_hub_dataset_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EyrieError, match="cannot resolve dataset nobody/nothing"):
        dataset.resolve("nobody/nothing")


def test_sample_ids_are_deterministic_and_distinct(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    a, b = dataset.resolve(str(path)), dataset.resolve(str(path))
    ids = [sample_id(a, i) for i in range(25)]
    assert ids == [sample_id(b, i) for i in range(25)] and len(set(ids)) == 25


@pytest.mark.parametrize("row,expected", [
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "U"},
                        {"from": "gpt", "value": "A"}, {"from": "human", "value": "U2"},
                        {"from": "gpt", "value": "A2"}]},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
      {"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]),
    ({"messages": [{"role": "user", "content": "hi"}]}, [{"role": "user", "content": "hi"}]),
    ({"conversations": [{"role": "User", "content": "hi"}]}, [{"role": "user", "content": "hi"}]),
    ({"conversations": [{"from": "human", "value": 3}]}, Skip("text_not_a_string")),
    ({"conversations": [{"from": "human"}]}, Skip("null_text")),
    ({"conversations": ["hi"]}, Skip("turn_not_an_object")),
    ({"conversations": [{"speaker": "x"}]}, Skip("turn_without_role_or_text")),
    ("text", Skip("row_not_an_object")),
])
def test_rows_to_prompts(row, expected):
    assert to_prompt(row) == expected


@pytest.mark.parametrize("where", ["empty", "root"])
def test_a_directory_that_is_not_a_dataset_is_refused_before_reading_it(tmp_path, where):
    folder = tmp_path if where == "empty" else "/"  # "/": never walked, let alone hashed
    if where == "empty":
        (tmp_path / "notes.md").write_text("not data")
        (tmp_path / ".hidden").mkdir()
        (tmp_path / ".hidden" / "x.jsonl").write_text("{}\n")
    # an empty one is refused by its contents; "/" at the latest by datasets' loader: one clear
    # error either way, after reading no more than the data files 2 levels down
    with pytest.raises(EyrieError, match="does not look like a dataset directory" if where == "empty" else "dataset /"):
        dataset.resolve(str(folder))
