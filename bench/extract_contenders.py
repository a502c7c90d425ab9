"""extract_throughput's contenders, timed on the same batches: the bare forward (hooks removed too), the store's
writes, the extractor, shard.py at a ref, the naive loop, and the proposals that swap the extractor's write pool;
and the meter of the cores busy meanwhile (ours and everyone else's)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import psutil
import torch
from safetensors.torch import save as st_save

from eyrie_extractor import shard as xs
from eyrie_extractor.shard import sample_tensors

from extract_setup import delete_prefix, run_shard


@contextlib.contextmanager
def hooks_removed(capture):
    saved = [(layer, dict(layer._forward_pre_hooks), dict(layer._forward_hooks))
             for layer in capture.decoder_layers]
    for layer, _, _ in saved:
        layer._forward_pre_hooks.clear()
        layer._forward_hooks.clear()
    try:
        yield
    finally:
        for layer, pre, post in saved:
            layer._forward_pre_hooks.update(pre)
            layer._forward_hooks.update(post)


@torch.inference_mode()
def plain_forward(capture, input_ids: list[list[int]]) -> None:
    """HFCapture.forward's padding and base-model call, without hooks and without the stack."""
    longest = max(len(ids) for ids in input_ids)
    ids = torch.zeros(len(input_ids), longest, dtype=torch.long)
    mask = torch.zeros(len(input_ids), longest, dtype=torch.long)
    for row, seq in enumerate(input_ids):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    base = getattr(capture.model, capture.model.base_model_prefix, capture.model)
    base(input_ids=ids.to(capture.device), attention_mask=mask.to(capture.device), use_cache=False)


class InlineExecutor:
    """ThreadPoolExecutor's submit/with, running each call at once in the caller's thread."""

    def __init__(self, *_args, **_kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False

    def submit(self, fn, *args, **kw) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kw))
        except BaseException as exc:  # noqa: BLE001 - handed back through the future, as a pool does
            future.set_exception(exc)
        return future


class SplitExecutor:
    """--variant split: the sample's bf16/fp8 tensors and safetensors bytes are made in the
    forward's thread; only store.put_bytes (sha256, write, fsync: mostly waiting) goes to one
    background thread. Prototype of a change to ExtractRunner._run/_write (entry fields as
    _write records them)."""

    def __init__(self, *_args, **_kw):
        self.pool = ThreadPoolExecutor(1)

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.pool.shutdown(wait=True)
        return False

    def submit(self, fn, item, states) -> Future:
        if getattr(fn, "__name__", "") != "_write":  # the code already splits (it submits _put): as it is
            return self.pool.submit(fn, item, states)
        runner = fn.__self__
        data = xs.save(xs.sample_tensors(states, item["input_ids"], runner.params.dtype))

        def put() -> dict:
            info = runner.store.put_bytes(runner.layout.extract_sample(runner.shard, item["sample_id"]), data)
            return {"sample_id": item["sample_id"], "row": item["row"], "status": "done", "key": info.key,
                    "sha256": info.sha256, "bytes": info.size, "seq_len": len(item["input_ids"]),
                    "prompt_len": item["prompt_len"], "source": item["source"],
                    "mismatch": item["mismatch"], "truncated": item["truncated"]}

        return self.pool.submit(put)


def _nice_write_threads() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread


def NiceExecutor(*args, **kw):  # noqa: N802 - stands in for the class
    """--variant nice: the same write threads at the lowest CPU priority (nice 19), so that on a
    CPU they run in the forward's gaps instead of preempting its OpenMP threads."""
    return ThreadPoolExecutor(*args, initializer=_nice_write_threads, **kw)


PAIRED = ("extract", "ref", "naive", "inline", "split", "nice")  # each measured right after a bare forward


VARIANTS = {  # name: (stand-in for ThreadPoolExecutor in eyrie_extractor.shard, description)
    "inline": (InlineExecutor, "`_write` run inline in the forward's thread (no write threads)"),
    "split": (SplitExecutor, "tensors + safetensors bytes made in the forward's thread, only put_bytes in "
                             "one write thread"),
    "nice": (NiceExecutor, "its write threads at nice 19 (`os.setpriority` in the pool's initializer)"),
}


class Bench:
    def __init__(self, args, store, conn, settings, capture, runs: dict[str, str], batches: list[list[list[int]]],
                 sync):
        self.args, self.store, self.conn, self.settings, self.capture = args, store, conn, settings, capture
        self.runs, self.batches, self.sync = runs, batches, sync
        self.tokens = sum(len(ids) for batch in batches for ids in batch)
        self.sizes = {}  # dtype -> bytes of every sample file, batch order
        n_states = len(capture.aux_layers) + 1
        for dtype in runs:
            by_len = {}
            for batch in batches:
                for ids in batch:
                    if len(ids) not in by_len:
                        dummy = torch.randn(len(ids), n_states, capture.hidden_size)
                        by_len[len(ids)] = len(st_save(sample_tensors(dummy, ids, dtype)))
            self.sizes[dtype] = [by_len[len(ids)] for batch in batches for ids in batch]
        self.blob = memoryview(os.urandom(max(max(s) for s in self.sizes.values())))

    # each returns an extra-info dict (may be empty); the caller times it

    def fwd(self) -> dict:
        for batch in self.batches:
            self.capture.forward(batch)
        return {}

    def fwd_plain(self) -> dict:
        with hooks_removed(self.capture):
            for batch in self.batches:
                plain_forward(self.capture, batch)
        return {}

    def write(self, dtype: str, threads: int) -> dict:
        keys = [f"runs/xb-write/{dtype}/blob-{i:06d}.safetensors" for i in range(len(self.sizes[dtype]))]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda ks: self.store.put_bytes(ks[0], self.blob[: ks[1]]),
                          zip(keys, self.sizes[dtype])))
        return {"bytes": sum(self.sizes[dtype])}

    def extract(self, dtype: str) -> dict:
        result = run_shard(xs, self.settings, self.conn, self.store, self.runs[dtype])
        assert result["status"] == "done" and result["tokens"] == self.tokens, result
        return {"own_wall_s": result["wall_s"], "bytes": result["bytes"]}

    def ref(self, dtype: str) -> dict:
        """ExtractRunner from shard.py at --ref (the rest of the tree as it is), same model object."""
        result = run_shard(self.ref_module, self.settings, self.conn, self.store, self.runs[dtype])
        assert result["status"] == "done" and result["tokens"] == self.tokens, result
        return {"own_wall_s": result["wall_s"], "bytes": result["bytes"]}

    def variant(self, which: str, dtype: str) -> dict:
        """A proposed change (--variant): the extractor with its write pool swapped, nothing else."""
        original = xs.ThreadPoolExecutor
        xs.ThreadPoolExecutor = VARIANTS[which][0]
        try:
            return self.extract(dtype)
        finally:
            xs.ThreadPoolExecutor = original

    def naive(self, dtype: str) -> dict:
        i, total = 0, 0
        for batch in self.batches:
            states = self.capture.forward(batch)
            for row, ids in enumerate(batch):
                host = states[row, : len(ids)].cpu()
                data = st_save(sample_tensors(host, ids, dtype))
                total += self.store.put_bytes(f"runs/xb-naive/{dtype}/s-{i:06d}.safetensors", data).size
                i += 1
        return {"bytes": total}

    def before(self, name: str) -> None:
        """Untimed: clear what the previous round of this contender left."""
        kind, _, dtype = name.partition("_")
        if kind in ("extract", "ref") or kind in VARIANTS:
            delete_prefix(self.store, f"runs/{self.runs[dtype]}/extract/")
        elif kind in ("write", "write1"):
            delete_prefix(self.store, f"runs/xb-write/{dtype}/")
        elif kind == "naive":
            delete_prefix(self.store, f"runs/xb-naive/{dtype}/")

    def call(self, name: str) -> dict:
        kind, _, dtype = name.partition("_")
        if name == "fwd_plain":
            return self.fwd_plain()
        if kind == "fwd":
            return self.fwd()
        if kind == "write":
            return self.write(dtype, self.settings.extract_write_threads)
        if kind == "write1":
            return self.write(dtype, 1)
        if kind in VARIANTS:
            return self.variant(kind, dtype)
        return getattr(self, kind)(dtype)


class LoadMeter:
    """Cores busy on the machine, ours (this process: every thread) and everyone else's."""

    def __init__(self, helpers: list[subprocess.Popen]):
        self.me = psutil.Process()
        self.helpers = [psutil.Process(p.pid) for p in helpers]

    def _ours(self) -> float:
        total = 0.0
        for proc in [self.me, *self.helpers]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self):
        return time.perf_counter(), self._busy(), self._ours()

    def stop(self, mark) -> dict:
        t0, busy0, ours0 = mark
        wall = time.perf_counter() - t0
        ours = self._ours() - ours0
        other = max(0.0, self._busy() - busy0 - ours)
        return {"wall_s": wall, "own_cores": ours / wall, "other_cores": other / wall}
