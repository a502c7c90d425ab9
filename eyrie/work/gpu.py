"""Who may use which GPUs now: a lease per device set in Redis, renewed by its holder, lapsing if it dies.

A lease over a set of GPUs takes one key per (host, device), all of them or none, in one Lua
script (atomic in Redis), each with a TTL its holder renews. So GPU stages on disjoint GPUs of
one host, or on different hosts, hold theirs side by side; sets that share a GPU wait for each
other, and a GPU never has two owners (but for the one case of sharing below). A process that
cannot say which of the host's GPUs it has (no EYRIE_GPU_IDS, NVIDIA_VISIBLE_DEVICES or
CUDA_VISIBLE_DEVICES) leases the whole host (`*`), which overlaps every set on it: one lease per
host, as before.

The inference service holds one while vLLM runs; extractor, trainer and verify take one before
GPU work. Status lists every holder and every waiter (`leases`).

Two holders may share a GPU in one case: the vLLM extraction service serving a run that trains
on demand (extract.storage hybrid or online) at a --gpu-memory-utilization that leaves the
trainer room, and that run's trainer. A lease's `mode` says which side it is:
- own (everyone else): the device keys; waits for every other holder, sharing or not.
- share (the extraction service): the devices' `:shared` keys; waits for own holders and other
  sharers, not for a trainer beside it (a trainer that got its GPU first must not keep the
  service it waits for from starting).
- beside (the trainer of such a run): the device keys; waits for own and beside holders, not
  for the sharer."""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path

import orjson
import redis

from eyrie.work import keys

TTL_S = 30
WHOLE_HOST = "*"  # the device id of a lease over every GPU of its host
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

# KEYS: the leases hash, the host's device index, the waiting hash, then the keys the lease sets.
# ARGV: token, TTL in ms, holder JSON, the host's device-key prefix, mode, then the device ids (as KEYS).
# Free or ours: every device wanted, and the whole host; `*` also needs every device ever leased
# on the host. A beside holder's token starts with "beside:", so a sharer can tell it apart.
_TAKE = """
local token, prefix, mode = ARGV[1], ARGV[4], ARGV[5]
local function clash(key)
  local holder = redis.call('GET', key)
  if not holder or holder == token then return false end
  return not (mode == 'share' and string.sub(holder, 1, 7) == 'beside:')
end
local function busy(device)
  return clash(prefix .. device) or (mode ~= 'beside' and clash(prefix .. device .. ':shared'))
end
if busy('*') then return 0 end
for i = 4, #KEYS do
  if ARGV[i + 2] == '*' then
    for _, device in ipairs(redis.call('SMEMBERS', KEYS[2])) do
      if busy(device) then return 0 end
    end
  elseif busy(ARGV[i + 2]) then
    return 0
  end
end
for i = 4, #KEYS do
  redis.call('SET', KEYS[i], token, 'PX', ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[i + 2])
end
redis.call('HSET', KEYS[1], token, ARGV[3])
redis.call('HDEL', KEYS[3], token)
return 1
"""

# KEYS: the leases hash, then the lease's device keys. ARGV: token.
_RELEASE = """
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""

# KEYS: the leases hash. The holders whose every device key still holds their token; the others
# (their holder died and the keys lapsed) are dropped.
_LIVE = """
local live = {}
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local token, info = entries[i], entries[i + 1]
  local ok, holder = pcall(cjson.decode, info)
  local alive = ok and type(holder['keys']) == 'table' and #holder['keys'] > 0
  if alive then
    for _, key in ipairs(holder['keys']) do
      if redis.call('GET', key) ~= token then alive = false break end
    end
  end
  if alive then table.insert(live, info) else redis.call('HDEL', KEYS[1], token) end
end
return live
"""


MODES = ("own", "share", "beside")


class GpuLease:
    """`devices`: what the stage computes on ("all", "cuda", "cuda:1", "cuda:0,cuda:1"; anything
    else, e.g. "cpu", leases the whole host); `host`: the machine (EYRIE_GPU_HOST, default
    `default_host()`); `gpu_ids`: the host's ids of this process's CUDA devices 0, 1, ...
    (EYRIE_GPU_IDS, default `visible_gpus()`). `caches`: functools caches holding models on the
    device, emptied before the lease goes. `mode`: own, share or beside (the module's doc); set it
    before `acquire`."""

    def __init__(self, conn: redis.Redis, owner: str, devices: str = "all", ttl_s: float = TTL_S,
                 caches: tuple = (), host: str | None = None, gpu_ids: str | None = None, mode: str = "own"):
        self.conn, self.owner, self.devices, self.ttl_s = conn, owner, devices, ttl_s
        self.caches = caches
        self.host = host or default_host()
        self.device_ids = device_set(devices, visible_gpus(gpu_ids))
        self.mode = mode
        self.since: float | None = None
        self._take, self._release = conn.register_script(_TAKE), conn.register_script(_RELEASE)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"GPU lease mode {mode!r}: one of {', '.join(MODES)}")
        self._mode = mode
        suffix = ":shared" if mode == "share" else ""
        self.keys = [keys.gpu_device(self.host, d) + suffix for d in self.device_ids]
        self.token = ("" if mode == "own" else f"{mode}:") + uuid.uuid4().hex

    def acquire(self, wait_s: float | None = None, poll_s: float = 1.0, stop=None, since: float | None = None) -> bool:
        """Block until every device of the set is ours (visible as waiting in status meanwhile, since
        `since`: when its task began to wait, else now); False after `wait_s`. `stop()`, asked every
        poll, ends the wait early by raising (a cancel, a SIGTERM)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        since = since or time.time()
        try:
            while True:
                if stop is not None:
                    stop()
                self.conn.hset(keys.GPU_WAITING, self.token, orjson.dumps(
                    {**self._who(), "since": since, "seen": time.time(), "poll_s": poll_s}))
                if self._try_take():  # also drops the waiting entry, in the same script
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(poll_s)
        finally:
            self.conn.hdel(keys.GPU_WAITING, self.token)

    def held(self) -> bool:
        return all(v in (self.token, self.token.encode()) for v in self.conn.mget(self.keys))

    def renew(self) -> None:
        """Extend every key's TTL (taking back any that lapsed while still free); raises
        LockNotOwnedError when another holder has one of them now."""
        if not self._try_take():
            raise redis.exceptions.LockNotOwnedError(
                f"the GPU lease of {self.owner} on {self.host}:{','.join(self.device_ids)} lapsed and "
                "another holder has its devices now")

    def release(self) -> None:
        free_device_memory(*self.caches)  # the next holder (vLLM) checks free memory at its start
        self._release(keys=[keys.GPU_LEASE, *self.keys], args=[self.token])
        self.since = None

    def _try_take(self) -> bool:
        self.since = self.since or time.time()
        holder = orjson.dumps({**self._who(), "since": self.since, "keys": self.keys})
        took = self._take(keys=[keys.GPU_LEASE, keys.gpu_host_devices(self.host), keys.GPU_WAITING, *self.keys],
                          args=[self.token, int(self.ttl_s * 1000), holder, keys.gpu_device(self.host, ""),
                                self.mode, *self.device_ids])
        if not took and not self.held():
            self.since = None
        return bool(took)

    def _who(self) -> dict:
        return {"owner": self.owner, "devices": self.devices, "gpus": self.device_ids, "gpu_host": self.host,
                "host": socket.gethostname(), "pid": os.getpid(), "mode": self.mode}


def in_mode(lease, mode: str):
    """`lease` (eyrie.tasks.gpu_admission.gpu_lease's) in sharing `mode`; a Kueue-admitted pod's
    GPUs are its own, so its lease has no mode."""
    if isinstance(lease, GpuLease):
        lease.mode = mode
    return lease


def default_host() -> str:
    """The machine whose GPUs these are, as every process on it names it: the kernel's boot id,
    which every container on the machine shares (each container has its own hostname, so two
    containers on the same GPUs would not meet under theirs); the hostname where there is none."""
    try:
        return "boot-" + BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def visible_gpus(gpu_ids: str | None = None) -> list[str] | None:
    """The host's ids of this process's CUDA devices 0, 1, ..., in order: `gpu_ids` (EYRIE_GPU_IDS)
    as given; else NVIDIA_VISIBLE_DEVICES (what Docker's --gpus and Compose's device_ids give a
    container) with CUDA_VISIBLE_DEVICES picking among them; else CUDA_VISIBLE_DEVICES. None when
    nothing says (every GPU of the host)."""
    given = _id_list(gpu_ids)
    if given is not None:
        return given
    base, cuda = _id_list(os.environ.get("NVIDIA_VISIBLE_DEVICES")), _id_list(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if cuda is None or base is None:
        return cuda if base is None else base
    return [base[int(c)] if c.isdigit() and int(c) < len(base) else c for c in cuda]


def _id_list(value: str | None) -> list[str] | None:
    ids = [part.strip() for part in (value or "").split(",") if part.strip()]
    if not ids or ids[0].lower() in ("all", "none", "void") or ids[0].startswith("-"):
        return None
    return ids


def device_set(devices: str, visible: list[str] | None) -> list[str]:
    """The host's GPU ids `devices` names, given the host's ids of the CUDA devices (`visible`,
    None: unknown, the indices are the host's): "all", "cuda" and "auto" are every visible GPU;
    "cuda:N,..." those; unknown, or anything else (cpu, a device index past the visible ones),
    the whole host."""
    spec = devices.strip().lower()
    if spec in ("all", "cuda", "auto"):
        return list(dict.fromkeys(visible)) if visible else [WHOLE_HOST]
    ids = []
    for part in spec.split(","):
        match = re.fullmatch(r"cuda:(\d+)", part.strip())
        if not match:
            return [WHOLE_HOST]
        index = int(match[1])
        if visible is not None and index >= len(visible):
            return [WHOLE_HOST]
        ids.append(visible[index] if visible is not None else str(index))
    return list(dict.fromkeys(ids))


def free_device_memory(*caches) -> None:
    """Drop our cached models, collect them, and hand the allocator's cached blocks back to the
    driver: the lease says who computes, the memory must follow it."""
    for cache in caches:
        cache.cache_clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def leases(conn: redis.Redis) -> dict | None:
    """Every live lease (oldest first) and every waiter: None when there are neither.
    `holder`: the oldest holder; `waiting`: the waiters' owners (as before per-device leases)."""
    holders = sorted((orjson.loads(raw) for raw in conn.register_script(_LIVE)(keys=[keys.GPU_LEASE])),
                     key=lambda h: h.get("since", 0))
    for h in holders:
        h.pop("keys", None)
    waiters, now = [], time.time()
    for token, raw in conn.hgetall(keys.GPU_WAITING).items():
        try:
            waiter = orjson.loads(raw)
        except orjson.JSONDecodeError:
            waiter = {}
        if not isinstance(waiter, dict) or now - waiter.get("seen", 0) > max(30.0, 5 * waiter.get("poll_s", 1.0)):
            conn.hdel(keys.GPU_WAITING, token)  # its process died while it waited
            continue
        waiters.append({k: waiter.get(k) for k in ("owner", "devices", "gpus", "gpu_host", "host", "since")})
    waiters.sort(key=lambda w: w.get("since") or 0)
    if not holders and not waiters:
        return None
    return {"holder": holders[0] if holders else None, "holders": holders,
            "waiting": sorted(w["owner"] for w in waiters), "waiters": waiters}


def holders_text(conn: redis.Redis) -> str:
    """Who holds GPU leases now, for an error: `owner on host:gpus, ...`."""
    found = leases(conn) or {"holders": []}
    return ", ".join(f"{h.get('owner')} on {h.get('gpu_host')}:{','.join(h.get('gpus') or [])}"
                     for h in found["holders"]) or "nobody now"


def holder(conn: redis.Redis) -> dict | None:
    """The oldest holder (None when free) and who is waiting (their owners)."""
    found = leases(conn)
    return None if found is None else {"holder": found["holder"], "waiting": found["waiting"]}


def pick_device(setting: str) -> str:
    """EYRIE_DEVICE: auto is cuda where there is one."""
    if setting == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting
