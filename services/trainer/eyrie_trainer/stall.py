"""A training that stops making progress (e.g. a data-loader worker that hangs) is named, its
stacks go to the log, and its data-loader workers are ended so the waiting step fails instead
of waiting for ever: the train runner then resumes from its last checkpoint."""

from __future__ import annotations

import faulthandler
import multiprocessing
import sys
import threading
import time
from typing import Callable


class StallWatch:
    """Watches `probe()` (anything that changes while training moves: its step count, its epoch).
    Unchanged for `limit_s`: says so with every thread's stack, and ends the data-loader workers if
    there are any (`ended`: their pids); with none to end it says so and watches on."""

    def __init__(self, limit_s: float, probe: Callable[[], object], say: Callable[[str], None], out=None):
        self.limit_s, self.probe, self.say, self.out = limit_s, probe, say, out
        self.ended: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eyrie-stall-watch", daemon=True)

    def __enter__(self) -> "StallWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

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
        workers = multiprocessing.active_children()  # speculators' data-loader workers (spawned)
        then = (f"ending its data-loader workers {[w.pid for w in workers]} so the waiting step fails and "
                "training resumes from its last checkpoint" if workers else
                "it has no data-loader worker to end (still watching)")
        self.say(f"training made no progress for {idle_s:.0f} s (EYRIE_TRAIN_STALL_S={self.limit_s:g}): every "
                 f"thread's stack follows in the trainer's log; {then}")
        faulthandler.dump_traceback(file=self.out or sys.stderr, all_threads=True)
        for worker in workers:
            worker.kill()
        self.ended = [w.pid for w in workers]
        return bool(workers)
