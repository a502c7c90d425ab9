"""bench/answers_carry.py: a run's generated answers saved from one store and restored into another (a
new sitting's), byte for byte, the run manifest last; hidden states and checkpoints stay behind."""

import pytest

from eyrie.data.manifest import Layout
from eyrie.data.store import FileStore

from answers_carry import restore_answers, save_answers

OBJECTS = {"manifest.json": b'{"run": "r"}', "pipeline.json": b"{}",
           "generate/input/shard-00000.jsonl": b'{"row": 0}\n',
           "generate/shards/shard-00000.jsonl": b'{"sample_id": "a"}\n',
           "generate/shards/shard-00000.manifest.json": b"{}",
           "generate/parts/shard-00001/part-00000.jsonl": b'{"sample_id": "b"}\n'}
LEFT = {"extract/shards/shard-00000/a.safetensors": b"states", "train/checkpoints/epoch-1/model.safetensors": b"w"}


def test_answers_saved_and_restored_byte_for_byte_without_states(tmp_path):
    source, layout = FileStore(tmp_path / "a"), Layout("r")
    for name, data in {**OBJECTS, **LEFT}.items():
        source.put_bytes(f"{layout.root}/{name}", data)
    archive = tmp_path / "r.tar.xz"
    assert save_answers(source, "r", archive) == len(OBJECTS)

    target = FileStore(tmp_path / "b")
    assert restore_answers(target, "r", archive) == len(OBJECTS)
    assert {k: target.get_bytes(k) for k in target.list("runs/")} == \
        {f"{layout.root}/{name}": data for name, data in OBJECTS.items()}
    assert restore_answers(target, "r", archive) == 0  # a store that has the run keeps it
    with pytest.raises(SystemExit, match="not of run other"):
        restore_answers(FileStore(tmp_path / "c"), "other", archive)
    with pytest.raises(SystemExit, match="nothing generated"):
        save_answers(source, "none", tmp_path / "none.tar.xz")
