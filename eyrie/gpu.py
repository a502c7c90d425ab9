"""Who may use the GPUs now: one lease in Redis, renewed by its holder, lapsing if it dies.

The inference service holds it while vLLM runs; extractor and trainer take it before GPU work.
Never two owners: acquisition is an atomic SET NX with a TTL."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time

import orjson
import redis
from redis.lock import Lock

from eyrie import keys

TTL_S = 30


class GpuLease:
    """`caches`: functools caches holding models on the device, emptied before the lease goes."""

    def __init__(self, conn: redis.Redis, owner: str, devices: str = "all", ttl_s: float = TTL_S,
                 caches: tuple = ()):
        self.conn, self.owner, self.devices, self.ttl_s = conn, owner, devices, ttl_s
        self.caches = caches
        self.lock = Lock(conn, keys.GPU_LEASE, timeout=ttl_s, thread_local=False)

    def acquire(self, wait_s: float | None = None, poll_s: float = 1.0) -> bool:
        """Block until the lease is ours (visible as waiting in status meanwhile)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        self.conn.hset(keys.GPU_WAITING, self.owner, time.time())
        try:
            while not self.lock.acquire(blocking=False):
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(poll_s)
        finally:
            self.conn.hdel(keys.GPU_WAITING, self.owner)
        self._publish()
        return True

    def held(self) -> bool:
        return self.lock.owned()

    def renew(self) -> None:
        self.lock.extend(self.ttl_s, replace_ttl=True)
        self._publish()

    def release(self) -> None:
        free_device_memory(*self.caches)  # the next holder (vLLM) checks free memory at its start
        try:
            self.lock.release()
        except redis.exceptions.LockError:
            pass
        self.conn.delete(keys.GPU_HOLDER)

    def _publish(self) -> None:
        info = {"owner": self.owner, "devices": self.devices, "host": socket.gethostname(),
                "pid": os.getpid(), "since": time.time()}
        self.conn.set(keys.GPU_HOLDER, orjson.dumps(info), px=int(self.ttl_s * 1000))


def free_device_memory(*caches) -> None:
    """Drop our cached models, collect them, and hand the allocator's cached blocks back to the
    driver: the lease says who computes, the memory must follow it."""
    for cache in caches:
        cache.cache_clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def holder(conn: redis.Redis) -> dict | None:
    """The current owner (None when free) and who is waiting."""
    raw = conn.get(keys.GPU_HOLDER) if conn.exists(keys.GPU_LEASE) else None
    waiting = sorted(k.decode() for k in conn.hkeys(keys.GPU_WAITING))
    if raw is None and not waiting:
        return None
    return {"holder": orjson.loads(raw) if raw else None, "waiting": waiting}


def pick_device(setting: str) -> str:
    """EYRIE_DEVICE: auto is cuda where there is one."""
    if setting == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting
