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
    Unchanged for `limit_s`: says so with every thread's stack, then ends the data-loader workers if
    there are any (`ended`: their pids), else raises `Stalled` in the training's thread (the main
    thread: a signal ends its blocking call; a native call that retries on EINTR is not ended).
    `fired`: it acted."""

    def __init__(self, limit_s: float, probe: Callable[[], object], say: Callable[[str], None], out=None):
        self.limit_s, self.probe, self.say, self.out = limit_s, probe, say, out
        self.ended: list[int] = []
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eyrie-stall-watch", daemon=True)
        self._interruptible, self._previous = False, None

    def __enter__(self) -> "StallWatch":
        if threading.current_thread() is threading.main_thread():  # only its signal handlers can raise there
            self._interruptible, self._previous = True, signal.signal(INTERRUPT, self._raise)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._interruptible:
            signal.signal(INTERRUPT, signal.SIG_DFL if self._previous is None else self._previous)

    def _raise(self, signum, frame) -> None:
        if self.fired and not self._stop.is_set():  # not once the training has returned
            raise Stalled(f"no progress for {self.limit_s:g} s (EYRIE_TRAIN_STALL_S)")

    def _watch(self) -> None:
        """Acts after each `limit_s` without progress until the training leaves the watch: an interrupt
        that landed where exceptions are ignored (a finalizer's `__del__`) is sent again."""
        seen, since = self.probe(), time.monotonic()
        while not self._stop.wait(min(10.0, self.limit_s / 4)):
            now = self.probe()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.limit_s:
                self._stalled(time.monotonic() - since)
                since = time.monotonic()

    def _stalled(self, idle_s: float) -> None:
        """Says so with every thread's stack, then ends the wait: the first time, the data-loader
        workers if there are any; else, and after that, an interrupt."""
        workers = [] if self.fired else multiprocessing.active_children()  # speculators' (spawned)
        interrupt = not workers and self._interruptible
        self.fired = self.fired or bool(workers) or interrupt
        then = (f"ending its data-loader workers {[w.pid for w in workers]}" if workers else
                "interrupting the training's wait" if interrupt else
                "it has no data-loader worker to end and trains outside the main thread (still watching)")
        if workers or interrupt:
            then += " so the waiting step fails and training resumes from its last checkpoint"
        self.say(f"training made no progress for {idle_s:.0f} s (EYRIE_TRAIN_STALL_S={self.limit_s:g}): every "
                 f"thread's stack follows in the trainer's log; {then}")
        faulthandler.dump_traceback(file=self.out or sys.stderr, all_threads=True)
        for worker in workers:
            worker.kill()
        self.ended += [w.pid for w in workers]
        if interrupt:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT)
