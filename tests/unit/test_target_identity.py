"""A target is identified by its content (issue 49 item 1): a local directory by the sha256 of every
file of its tree, each read once per host (eyrie.core.file_hashes caches them by device, inode, size
and mtime); a hub id by its commit and the hub's own digests of its files. Every test has a hash
cache of its own (XDG_CACHE_HOME in tmp_path)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

from eyrie.core import file_hashes
from eyrie.core.file_hashes import HashCache, default_cache_path, file_sha256, uncached_bytes
from eyrie.core.target import describe, same_target
from eyrie.runs.plan_lines import _duration, _identity_lines

HOUR_NS = 3600 * 10**9
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def write(path: Path, data: bytes, mtime_ns: int | None = None) -> Path:
    """A file whose mtime is an hour ago (past the racy window: its digest is cached), or `mtime_ns`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    stamp = mtime_ns if mtime_ns is not None else time.time_ns() - HOUR_NS
    os.utime(path, ns=(stamp, stamp))
    return path


def target(root: Path) -> Path:
    write(root / "config.json", json.dumps({"max_position_embeddings": 2048}).encode())
    write(root / "tokenizer_config.json", json.dumps({"chat_template": TEMPLATE}).encode())
    write(root / "model.safetensors", bytes(range(256)) * 256)  # 64 kB
    return root


def flip_4k(path: Path) -> None:
    """4 kB of the file overwritten in place: same inode, same size."""
    with open(path, "r+b") as f:
        f.seek(8192)
        block = f.read(4096)
        f.seek(8192)
        f.write(bytes(b ^ 0xFF for b in block))


def test_the_same_content_at_another_path_is_the_same_revision(tmp_path):
    a = describe(str(target(tmp_path / "a")))
    b = describe(str(shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")))
    assert a.revision == b.revision and a.revision.startswith("sha256:") and a.model != b.model
    assert a.files == b.files and set(a.files) == {"config.json", "tokenizer_config.json", "model.safetensors"}
    assert a.max_model_len == 2048 and a.chat_template_sha256 and a.hub_id is None
    assert describe(str(tmp_path / "a"), hub_id="org/model").hub_id == "org/model"


def test_weights_changed_in_place_at_the_same_size_change_the_revision(tmp_path):
    root = target(tmp_path / "t")
    weights = root / "model.safetensors"
    first, size = describe(str(root)), weights.stat().st_size
    flip_4k(weights)  # its mtime now's
    second = describe(str(root))
    assert weights.stat().st_size == size and second.revision != first.revision
    assert second.files["model.safetensors"] != first.files["model.safetensors"]
    for turn in (1, 2):  # back, then changed again: same size, each at another mtime past the racy window
        flip_4k(weights)
        stamp = time.time_ns() - HOUR_NS + turn * 10**9
        os.utime(weights, ns=(stamp, stamp))
        assert describe(str(root)).revision == (first if turn == 1 else second).revision


def test_weights_changed_in_place_with_their_mtime_put_back_by_hand_change_the_revision(tmp_path):
    """Same size, same mtime as when the digest was kept: the ctime (which no user can set) tells."""
    root = target(tmp_path / "t")
    weights = root / "model.safetensors"
    first, kept = describe(str(root)), weights.stat()
    flip_4k(weights)
    os.utime(weights, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    assert describe(str(root)).revision != first.revision


def test_a_nested_file_counts_and_hidden_files_and_the_conversion_record_do_not(tmp_path):
    root = target(tmp_path / "t")
    write(root / "subdir" / "x.safetensors", b"one")
    first = describe(str(root))
    assert "subdir/x.safetensors" in first.files
    write(root / ".cache" / "huggingface" / "download.lock", b"anything")
    write(root / ".gitattributes", b"*.safetensors filter=lfs")
    write(root / "eyrie-conversion.json", json.dumps({"tools": {"torch": "2.9"}}).encode())
    described = describe(str(root))
    assert described.revision == first.revision and described.conversion == {"tools": {"torch": "2.9"}}
    write(root / "subdir" / "x.safetensors", b"two")
    assert describe(str(root)).revision != first.revision


def test_the_revision_is_what_sha256sum_of_the_tree_gives(tmp_path):
    """`find . -type f -not -path '*/.*' | LC_ALL=C sort | xargs sha256sum | sha256sum`, here by hand."""
    root = target(tmp_path / "t")
    write(root / "subdir" / "x.safetensors", b"one")
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(root).as_posix()}\n"
                    for p in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()) if p.is_file())
    assert describe(str(root)).revision == "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def test_a_second_look_at_an_unchanged_directory_reads_no_file(tmp_path, monkeypatch):
    root = target(tmp_path / "t")
    first = describe(str(root))
    assert uncached_bytes(root) == 0
    hits = file_hashes.counts["cache_hits"]

    def no_read(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(file_hashes, "stream_sha256", no_read)
    assert describe(str(root)).revision == first.revision
    assert file_hashes.counts["cache_hits"] == hits + 3


def test_a_file_changed_this_recently_is_not_cached(tmp_path):
    """Within the same mtime tick a write leaves (size, mtime) as they were: such a file is read at every look."""
    path = write(tmp_path / "t" / "w.bin", b"x" * 100, mtime_ns=time.time_ns())
    with HashCache(default_cache_path()) as cache:
        file_sha256(path, cache)
        read = file_hashes.counts["hashed_files"]
        file_sha256(path, cache)
    assert file_hashes.counts["hashed_files"] == read + 1 and uncached_bytes(tmp_path / "t") == 100


def test_a_corrupt_or_unusable_cache_never_fails_the_hash(tmp_path, cache_home):
    root = target(tmp_path / "t")
    expected = describe(str(root)).revision
    default_cache_path().write_bytes(b"not a database" * 100)
    assert describe(str(root)).revision == expected  # replaced by a new cache
    with sqlite3.connect(default_cache_path()) as db:
        assert db.execute("SELECT count(*) FROM digests").fetchone()[0] == 3
    shutil.rmtree(cache_home)
    cache_home.write_text("a file where the cache's folder would be")
    assert describe(str(root)).revision == expected


def test_the_plan_says_what_the_first_look_costs_and_a_stat_after(tmp_path):
    root = target(tmp_path / "t")
    plan = SimpleNamespace(target=str(root), target_download_bytes=0)
    (line,) = _identity_lines(plan)
    assert "target identity: first hash of" in line and "bench/RESULTS.md" in line and "a stat per file" in line
    describe(str(root))
    assert _identity_lines(plan) == ["  target identity: every file's sha256 is in this host's hash cache: "
                                     "a stat per file"]
    assert [_duration(s) for s in (0.0016, 45, 540e9 / 1.3e9, 6000)] == ["0.0016 s", "45 s", "7 min", "1.7 h"]
    assert "nothing hashed" in _identity_lines(SimpleNamespace(target="org/model", target_download_bytes=10))[0]


class FakeHfApi:
    """A test double of huggingface_hub.HfApi: no hub is reachable from the tests."""

    siblings = [RepoSibling("config.json", 40, blob_id="a" * 40),
                RepoSibling("model-00001-of-00002.safetensors", 10**9, blob_id="b" * 40,
                            lfs=BlobLfsInfo(size=10**9, sha256="c" * 64, pointer_size=134)),
                RepoSibling(".gitattributes", 1500, blob_id="d" * 40)]

    def model_info(self, model, files_metadata=False):
        assert files_metadata, "the files' digests come with files_metadata=True"
        return SimpleNamespace(sha="f" * 40, siblings=self.siblings)


def test_a_hub_target_is_its_commit_and_the_hubs_digests_of_its_files(tmp_path, monkeypatch):
    """The hub branch against FakeHfApi (no hub is reachable here): LFS files by their sha256, the others
    by their git blob id; offline, the run records the name alone."""
    configs = target(tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda model, name, revision: str(configs / name))
    info = describe("org/model")
    assert (info.revision, info.hub_id, info.max_model_len) == ("f" * 40, "org/model", 2048)
    assert info.files == {"config.json": "git:" + "a" * 40, "model-00001-of-00002.safetensors": "c" * 64}
    assert info.chat_template_sha256 == describe(str(configs)).chat_template_sha256
    assert same_target(info, describe("org/model")) and not same_target(info, describe(str(configs)))

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(FakeHfApi, "model_info", offline)
    assert describe("org/model").revision == "unresolved" and describe("org/model").files is None
