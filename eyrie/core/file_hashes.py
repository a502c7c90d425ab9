"""Local files' sha256, each read once per host: a digest is kept in a small sqlite file keyed by the
file's (device, inode, size, mtime, ctime), so a later look at an unchanged file costs a stat. A file
written in place gets a new mtime and ctime, so it is read again, even where its mtime was put back by
hand (touch -d, os.utime: the ctime cannot be; a chmod costs a read again). The cache only saves time: a corrupt, locked or
unwritable one means the file is read again, never a failed hash."""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import tempfile
import time
from collections import Counter
from pathlib import Path

# One core's sha256 of a file in the page cache: 1.32 GB/s, the median of bench/hash_speed.py's 3 rounds
# on a shared 2-vCPU AMD EPYC with the SHA extensions (bench/RESULTS.md, "Target identity: hashing
# cost"), rounded down: what `eyrie run --plan` projects a local target's first look at.
HASH_BYTES_PER_S = 1.3e9
CHUNK_BYTES = 4 << 20
# A file modified this recently may be modified again within the same mtime tick (the kernel's coarse
# clock; FAT's 2 s): its digest is not kept, as git treats a "racily clean" index entry.
RACY_NS = 2_000_000_000
SCHEMA = ("CREATE TABLE IF NOT EXISTS digests (file TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
          "ctime_ns INTEGER, sha256 TEXT)")

counts: Counter = Counter()  # hashed_files, hashed_bytes, cache_hits: what a look cost (tests, benches)
log = logging.getLogger(__name__)


def default_cache_path() -> Path:
    """$XDG_CACHE_HOME/eyrie/file-hashes.sqlite, ~/.cache/eyrie/... where it is unset (or not absolute);
    a user without a home (a container's arbitrary uid) keeps it in the temporary directory."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    except RuntimeError:
        root = Path(tempfile.gettempdir()) / f"cache-{os.getuid()}"
    return root / "eyrie" / "file-hashes.sqlite"


class HashCache:
    """The digests of one sqlite file, opened at its first use; sqlite's lock (with a timeout) keeps
    concurrent processes apart, and a write that loses costs only a later rehash."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_cache_path()
        self._db: sqlite3.Connection | None = None
        self._opened = False

    def __enter__(self) -> HashCache:
        return self

    def __exit__(self, *exc) -> None:
        if self._db is not None:
            self._db.close()
        self._db, self._opened = None, False

    def get(self, stat: os.stat_result) -> str | None:
        db = self._connection()
        try:
            row = db and db.execute("SELECT sha256 FROM digests WHERE file = ? AND size = ? AND mtime_ns = ? "
                                    "AND ctime_ns = ?", (_file_key(stat), stat.st_size, stat.st_mtime_ns,
                                                          stat.st_ctime_ns)).fetchone()
        except (sqlite3.Error, OverflowError):
            return None
        return row[0] if row else None

    def put(self, stat: os.stat_result, digest: str) -> None:
        db = self._connection()
        try:
            if db is not None:
                with db:  # one commit a file: hours of hashing interrupted keep what was done
                    db.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?)",
                               (_file_key(stat), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, digest))
        except (sqlite3.Error, OverflowError) as exc:
            log.debug("hash cache %s not written: %s", self.path, exc)

    def _connection(self) -> sqlite3.Connection | None:
        if not self._opened:
            self._opened, self._db = True, _open(self.path)
        return self._db


def _open(path: Path) -> sqlite3.Connection | None:
    """The cache's connection, its table made; a file that is not a database is replaced; None where
    the cache cannot be used at all (an unwritable directory, locked past the timeout)."""
    try:
        return _connect(path)
    except sqlite3.OperationalError as exc:  # locked, read-only, cannot open: this look goes without
        reason = exc
    except sqlite3.DatabaseError:  # not a database (corrupt): started again
        try:
            path.unlink(missing_ok=True)
            return _connect(path)
        except (sqlite3.Error, OSError) as exc:
            reason = exc
    except OSError as exc:
        reason = exc
    log.warning("the file hash cache %s cannot be used (%s): files are read in full", path, reason)
    return None


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=10)
    try:
        db.execute(SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _file_key(stat: os.stat_result) -> str:
    return f"{stat.st_dev}:{stat.st_ino}"  # text: an inode number may not fit sqlite's signed 64 bits


def stream_sha256(path: Path) -> str:
    """The file's sha256, read in CHUNK_BYTES reads (no cache)."""
    digest, buffer = hashlib.sha256(), bytearray(CHUNK_BYTES)
    view, size = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    counts["hashed_files"] += 1
    counts["hashed_bytes"] += size
    return digest.hexdigest()


def file_sha256(path: Path, cache: HashCache | None = None) -> str:
    """The file's sha256 (hex): from the cache where the file's (device, inode, size, mtime, ctime) is there,
    else read and kept (unless it changed while read, or so recently it may change unseen)."""
    if cache is None:
        with HashCache() as own:
            return file_sha256(path, own)
    before = os.stat(path)
    if (digest := cache.get(before)) is not None:
        counts["cache_hits"] += 1
        return digest
    started = time.time_ns()
    digest = stream_sha256(path)
    after = os.stat(path)
    unchanged = (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ctime_ns, before.st_ino)
    if unchanged and started - before.st_mtime_ns > RACY_NS:
        cache.put(before, digest)
    return digest


def tree_files(root: Path) -> dict[str, Path]:
    """Every file under `root` by its relative posix path, sorted; hidden files and directories (.git,
    .cache) left out; symlinks followed (an HF snapshot's files are links to its blobs), each
    directory once."""
    found, seen = {}, set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(folder, name)
            if not name.startswith(".") and path.is_file():
                found[path.relative_to(root).as_posix()] = path
    return dict(sorted(found.items()))


def tree_sha256(root: Path, skip: frozenset[str] = frozenset(), cache_path: Path | None = None) -> dict[str, str]:
    """Each file of the tree (tree_files, less the relative paths in `skip`) -> its sha256."""
    with HashCache(cache_path) as cache:
        return {rel: file_sha256(path, cache) for rel, path in tree_files(root).items() if rel not in skip}


def uncached_bytes(root: Path, cache_path: Path | None = None) -> int:
    """The bytes a look at the tree would read now: its files whose digest this host's cache lacks."""
    with HashCache(cache_path) as cache:
        stats = [os.stat(path) for path in tree_files(root).values()]
        return sum(st.st_size for st in stats if cache.get(st) is None)
