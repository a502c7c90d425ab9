"""One rule for every wait of a task for the GPUs (issue 41, item 6), whoever waits: the task for its
own GPU lease (extract, train, verify: eyrie.tasks.gpu_admission.acquire_within), or for a server
that waits for its lease (generate's inference server, eyrie.work.inference.wait_serving; the vLLM
extraction server of extract and of a training on demand, eyrie.work.extract_server.ServerWait).

- The wait lasts at most EYRIE_GPU_WAIT_S in all, counted from the task's first look that found
  the GPUs held, across its hand-backs (kept in its RQ job's meta). Past it the task fails for
  good, its error naming who holds the GPUs and what to do; RQ does not retry it (that would be
  the same wait again): `eyrie retry` does, once the holder is dealt with, and waits afresh.
- One RQ job of the task waits at most a slice of it (SLICE_S, or a quarter of the job's timeout
  where that is shorter), then hands the task back to its queue (WaitingForGpus): neither a
  failed attempt nor one of its hand-backs on a stop (eyrie.work.queue.HAND_BACKS); the worker
  takes it up again and it waits on. So the job's RQ timeout counts its work (and at most one
  slice of waiting), never the wait for the GPUs, however long the holder keeps them.
- A cancel of the run or its worker's SIGTERM ends the wait at once (the caller's `stop`).

Outside an RQ job (a container's task, a task run in process, `eyrie verify`) there is no queue to
go back to: the whole bound is waited in one go."""

from __future__ import annotations

import time
from collections.abc import Callable

from rq import get_current_job

from eyrie.core.errors import EyrieError
from eyrie.work.cancel import Stopping
from eyrie.work.gpu import holders_text

SLICE_S = 60.0
SINCE = "gpu_wait_since"  # the RQ job meta's field: when the task began to wait (wall clock)


class WaitingForGpus(Stopping):
    """The task's RQ job waited its slice for the GPUs: the task goes back to its queue to wait on
    (handed back as on a stop request, but not counted as one)."""

    counted = False


class GpuWait:
    """One task's wait for the GPUs under the rule above; `what()` names what it waits for in its
    messages (e.g. "the GPU lease of cuda:0 on HOST"). `check(conn)` at each look that finds the
    GPUs held: it raises once this job's slice or the whole bound is spent. `over()` once they are
    not (had, or no longer waited for): a later wait of the task counts afresh."""

    def __init__(self, bound_s: float, what: Callable[[], str]):
        self.bound_s, self.what = bound_s, what
        self.job = get_current_job()
        self.since: float | None = self.job.meta.get(SINCE) if self.job is not None else None
        self.began: float | None = None  # when this job began to wait (monotonic)
        self.slice_s = _slice_s(self.job.timeout) if self.job is not None else None

    def check(self, conn) -> None:
        """The GPUs are held now. Past the bound: the task's final error, naming the holders. Past
        this job's slice: WaitingForGpus (back to its queue)."""
        if self.since is None:
            self.since = time.time()
            self._keep(self.since)  # the next job of the task waits on from here
        self.began = self.began or time.monotonic()
        waited = time.time() - self.since
        if waited >= self.bound_s:
            self.over()
            if self.job is not None:
                self.job.retries_left = 0  # RQ's retry would be the same wait again: `eyrie retry` decides
            raise EyrieError(f"waited {waited:.0f} s for {self.what()} (at most {self.bound_s:g} s: EYRIE_GPU_WAIT_S) "
                             f"and the GPUs are still held (holders: {holders_text(conn)}).",
                             "let the holder finish, or stop it (`eyrie status` shows the GPU leases and who "
                             f"waits), or raise EYRIE_GPU_WAIT_S; then {self._again()}.")
        if self.slice_s is not None and time.monotonic() - self.began >= self.slice_s:
            raise WaitingForGpus(f"waited {waited:.0f} s of at most {self.bound_s:g} s (EYRIE_GPU_WAIT_S) for "
                                 f"{self.what()}, held by {holders_text(conn)}: back to its queue to wait on")

    def left_s(self) -> float:
        """How long this job may wait from now before its next `check` (>= 0); after a `check`."""
        left = self.bound_s - (time.time() - self.since)
        if self.slice_s is not None:
            left = min(left, self.slice_s - (time.monotonic() - self.began))
        return max(0.0, left)

    def over(self) -> None:
        """The wait has ended: a later one of the same task counts afresh."""
        self.began = None
        if self.since is not None:
            self.since = None
            self._keep(None)

    def _again(self) -> str:
        run = (self.job.args[0] or {}).get("run") if self.job is not None and self.job.args else None
        return f"`eyrie retry {run}` waits for them again" if isinstance(run, str) else "run it again"

    def _keep(self, since: float | None) -> None:
        if self.job is None:
            return
        if since is None:
            self.job.meta.pop(SINCE, None)
        else:
            self.job.meta[SINCE] = since
        self.job.save_meta()


def _slice_s(timeout: float | None) -> float:
    """One RQ job's share of a wait: SLICE_S, or a quarter of its timeout where that is shorter."""
    return min(SLICE_S, timeout / 4) if timeout and timeout > 0 else SLICE_S
