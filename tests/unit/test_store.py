"""The same suite against both store backends: a local directory and a real S3 server (SeaweedFS)."""

import os
import threading

import pytest

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.data.store import CorruptObject, open_store, sha256_bytes


@pytest.fixture
def store(store_env, monkeypatch):
    for key, value in store_env.items():
        monkeypatch.setenv(key, value)
    return open_store(load_settings())


def test_put_get_roundtrip_with_checksum(store):
    info = store.put_bytes("runs/a/x.bin", b"hello")
    assert info.size == 5 and info.sha256 == sha256_bytes(b"hello")
    assert store.get_bytes("runs/a/x.bin") == b"hello"
    assert store.exists("runs/a/x.bin") and not store.exists("runs/a/y.bin")


def test_list_is_recursive_and_prefix_bounded(store):
    for key in ("runs/a/1", "runs/a/sub/2", "runs/ab/3", "runs/b/4"):
        store.put_bytes(key, b"x")
    assert store.list("runs/a/") == ["runs/a/1", "runs/a/sub/2"]
    assert store.list("runs/b/") == ["runs/b/4"]
    assert store.list("runs/none/") == []


def test_delete_and_missing_key(store):
    store.put_bytes("k", b"v")
    store.delete("k")
    assert not store.exists("k")
    with pytest.raises(KeyError):
        store.get_bytes("k")


def test_json_helpers(store):
    store.put_json("m.json", {"a": [1, 2]})
    assert store.get_json("m.json") == {"a": [1, 2]}


def test_verified_read_detects_corruption(store):
    info = store.put_bytes("shard", b"good data")
    assert store.get_verified("shard", info.sha256) == b"good data"
    store.put_bytes("shard", b"bad data!")
    with pytest.raises(CorruptObject, match="does not match its recorded sha256"):
        store.get_verified("shard", info.sha256)


def test_readers_never_see_a_partial_object(store):
    """While a large object is rewritten, every read returns one whole version."""
    old, new = b"a" * 3_000_000, b"b" * 3_000_000
    store.put_bytes("big", old)
    seen, stop = set(), threading.Event()

    def reader():
        while not stop.is_set():
            seen.add(sha256_bytes(store.get_bytes("big")))

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(3):
        store.put_bytes("big", new)
        store.put_bytes("big", old)
    stop.set()
    thread.join()
    assert seen <= {sha256_bytes(old), sha256_bytes(new)}


def test_bad_keys_are_refused(store):
    for key in ("", "/abs", "a/../b"):
        with pytest.raises(ValueError):
            store.put_bytes(key, b"x")


def test_unreachable_s3_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("EYRIE_STORE_URL", "s3://bucket")
    monkeypatch.setenv("EYRIE_S3_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("EYRIE_S3_ACCESS_KEY", "a")
    monkeypatch.setenv("EYRIE_S3_SECRET_KEY", "b")
    with pytest.raises(EyrieError, match="cannot reach the S3 endpoint http://127.0.0.1:1"):
        open_store(load_settings())


@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
def test_processes_opening_a_new_bucket_at_once_all_get_it(store_env, monkeypatch):
    """Workers and `eyrie run` start together on a new bucket: each sees it missing, one makes it,
    the others' make_bucket is answered BucketAlreadyOwnedByYou (the real server's answer, checked
    first), which is success, not an error about keys."""
    from minio.error import S3Error

    for key, value in store_env.items():
        monkeypatch.setenv(key, value)
    first = open_store(load_settings())
    with pytest.raises(S3Error) as made_twice:
        first.client.make_bucket(first.bucket)
    assert made_twice.value.code == "BucketAlreadyOwnedByYou"
    for attempt in range(3):
        monkeypatch.setenv("EYRIE_STORE_URL", f"s3://eyrie-race-{os.getpid()}-{attempt}/runs")
        settings, start, errors = load_settings(), threading.Barrier(8), []

        def open_at_once():
            start.wait()
            try:
                open_store(settings).put_bytes("k", b"v")
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=open_at_once) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_files_stream_in_and_out_verified(store, tmp_path):
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(9 * (1 << 20) + 7))  # several read blocks, not a multiple
    info = store.put_file("ck/big.bin", source)
    assert info.size == source.stat().st_size and info.sha256 == sha256_bytes(source.read_bytes())
    assert store.get_bytes("ck/big.bin") == source.read_bytes()
    out = store.get_file("ck/big.bin", info.sha256, tmp_path / "out" / "big.bin")
    assert out.read_bytes() == source.read_bytes()
    with pytest.raises(CorruptObject):
        store.get_file("ck/big.bin", "0" * 64, tmp_path / "out" / "bad.bin")
    assert not (tmp_path / "out" / "bad.bin").exists() and len(list((tmp_path / "out").iterdir())) == 1
    with pytest.raises(KeyError):
        store.get_file("ck/missing.bin", info.sha256, tmp_path / "out" / "missing.bin")
