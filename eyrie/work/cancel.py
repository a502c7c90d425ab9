"""A run's cancel as its tasks see it: the exception a task raises to stop, and the watch it polls."""

from __future__ import annotations

import time

from eyrie.work import keys


class Cancelled(Exception):
    """The run was cancelled while a task of it ran in the worker's own process."""


class CancelWatch:
    """Whether the run has been cancelled, asked of Redis at most every `every_s`: tasks that run
    in the worker process (extract, train) poll it between batches or steps and stop cleanly."""

    def __init__(self, conn, run: str, every_s: float = 2.0):
        self.conn, self.run, self.every_s = conn, run, every_s
        self.seen, self._asked = False, 0.0

    def __call__(self) -> bool:
        if not self.seen and time.monotonic() - self._asked >= self.every_s:
            self._asked = time.monotonic()
            self.seen = bool(self.conn.exists(keys.cancelled(self.run)))
        return self.seen
