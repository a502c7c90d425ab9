"""A training that stops making progress (a data-loader worker that hangs, a request that never
answers) is named, its stacks go to the log, and the wait is ended so the waiting step fails
instead of waiting for ever: the train runner then resumes from its last checkpoint. With
data-loader workers (speculators' spawned ones, on a GPU host) they are ended; with none (the
CPU default) the training thread itself is interrupted (`Stalled`)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import signal
import sys
import threading
import time
from typing import Callable

INTERRUPT = signal.SIGUSR2  # eyrie's SIGUSR1 prints the stacks; RQ's job timeout is SIGALRM


class Stalled(BaseException):
    """Raised in the stalled training thread. A BaseException, as KeyboardInterrupt is: the data
    path's `except Exception` retries (speculators' requests to the extraction service) must not
    swallow it."""


class StallWatch:
    """Watches `probe()` (anything that changes while training moves: its step count, its epoch).
    Unchanged for `limit_s`: says so with every thread's stack, then ends the wait. With data-loader
    workers (`interrupt` False) it ends them once they exist (`ended`: their pids). With none
    (`interrupt`: the CPU default) it raises `Stalled` in the training's thread, the main thread (a
    signal ends its blocking call; a native call that retries on EINTR is not ended), again after
    each further `limit_s`: never inside an import or a finalizer, where it would leave a module
    half-imported or be ignored. `fired`: it acted."""

    def __init__(self, limit_s: float, probe: Callable[[], object], say: Callable[[str], None], out=None,
                 interrupt: bool = False):
        self.limit_s, self.probe, self.say, self.out = limit_s, probe, say, out
        self.interrupt = interrupt and threading.current_thread() is threading.main_thread()
        self.ended: list[int] = []
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eyrie-stall-watch", daemon=True)
        self._previous = None

    def __enter__(self) -> "StallWatch":
        if self.interrupt:
            self._previous = signal.signal(INTERRUPT, self._raise)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.interrupt:
            signal.signal(INTERRUPT, signal.SIG_DFL if self._previous is None else self._previous)

    def _raise(self, signum, frame) -> None:
        if self.fired and not self._stop.is_set() and not _unsafe(frame):  # skipped: sent again later
            raise Stalled(f"no progress for {self.limit_s:g} s (EYRIE_TRAIN_STALL_S)")

    def _watch(self) -> None:
        seen, since = self.probe(), time.monotonic()
        while not self._stop.wait(min(10.0, self.limit_s / 4)):
            now = self.probe()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.limit_s:
                if self._stalled(time.monotonic() - since):
                    return
                since = time.monotonic()

    def _stalled(self, idle_s: float) -> bool:
        """Says so with every thread's stack, then ends the wait where it can. True: watch no more
        (the data-loader workers ended: the waiting step fails)."""
        workers = [] if self.interrupt else loader_workers()
        self.fired = self.fired or bool(workers) or self.interrupt
        then = (f"ending its data-loader workers {[w.pid for w in workers]}" if workers else
                "interrupting the training's wait" if self.interrupt else
                "it has no data-loader worker to end (still watching)")
        if workers or self.interrupt:
            then += " so the waiting step fails and training resumes from its last checkpoint"
        self.say(f"training made no progress for {idle_s:.0f} s (EYRIE_TRAIN_STALL_S={self.limit_s:g}): every "
                 f"thread's stack follows in the trainer's log; {then}")
        faulthandler.dump_traceback(file=self.out or sys.stderr, all_threads=True)
        for worker in workers:
            worker.kill()
        self.ended = [w.pid for w in workers]
        if self.interrupt:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT)
        return bool(workers)


def loader_workers() -> list[multiprocessing.Process]:
    """This process's data-loader workers: its spawned children (speculators' loader spawns them); not
    RQ's scheduler process, a forked child of a worker that is not in burst mode."""
    return [p for p in multiprocessing.active_children() if isinstance(p, multiprocessing.context.SpawnProcess)]


def _unsafe(frame) -> bool:
    """Whether raising here would half-import a module or be ignored (a finalizer's `__del__`)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
