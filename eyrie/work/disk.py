"""Free space where the bytes go, measured where they go, for `eyrie run --plan`. The trainer keeps
a local copy of a run's hidden states in its cache directory (EYRIE_CACHE_DIR; in the stack the
host's EYRIE_TRAINER_CACHE_DIR): every `eyrie worker train` reports that directory's free space to
Redis beside its heartbeat (every REPORT_S, kept for TTL_S), and --plan reads the reports instead
of measuring its own filesystem. The bucket's free space comes from the S3 server itself
(eyrie.data.store.S3Store.free_bytes)."""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from pathlib import Path

import orjson
import redis

from eyrie.work import keys

REPORT_S = 30.0
TTL_S = 120
log = logging.getLogger("eyrie.work.disk")


def usage(path: str | Path) -> dict:
    """Free and total bytes of the filesystem behind `path` (its nearest existing parent)."""
    current = Path(path).expanduser().resolve()
    while not current.exists() and current != current.parent:
        current = current.parent
    total, _, free = shutil.disk_usage(current)
    return {"dir": str(Path(path).expanduser().resolve()), "free": free, "total": total,
            "host": socket.gethostname(), "at": time.time()}


def report(conn: redis.Redis, stage: str, path: str | Path) -> dict:
    """Publish the free space of `path` for `stage` (one key per host, lapsing with its reporter)."""
    found = usage(path)
    conn.set(keys.disk_report(stage, found["host"]), orjson.dumps(found), ex=TTL_S)
    return found


def start_reporting(conn: redis.Redis, stage: str, path: str | Path, every_s: float = REPORT_S) -> threading.Event:
    """A daemon thread that reports every `every_s` until the returned event is set."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                report(conn, stage, path)
            except (redis.RedisError, OSError) as exc:  # Redis away for a while: the next report comes
                log.warning("could not report the free space of %s: %s", path, exc)
            stop.wait(every_s)

    threading.Thread(target=loop, name=f"disk-report-{stage}", daemon=True).start()
    return stop


def reported(redis_url: str, stage: str) -> list[dict]:
    """Every live report of `stage`, fewest free bytes first; [] where Redis cannot be reached
    within a second (a --plan far from the stack)."""
    try:
        conn = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=1)
        raw = [conn.get(key) for key in conn.scan_iter(keys.disk_report(stage, "*"))]
    except (redis.RedisError, OSError, ValueError):
        return []
    found = []
    for item in raw:
        try:
            found.append(orjson.loads(item))
        except (orjson.JSONDecodeError, TypeError):
            continue
    return sorted((r for r in found if isinstance(r, dict) and isinstance(r.get("free"), int)),
                  key=lambda r: r["free"])
