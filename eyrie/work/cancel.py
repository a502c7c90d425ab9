"""A run's cancel as its tasks see it: the exception a task raises to stop, and the watch it polls; the
worker's stop request (SIGTERM), on which a task hands its work back; and a run blocked by a refusal."""

from __future__ import annotations

import logging
import threading
import time

from eyrie.work import keys


class Cancelled(Exception):
    """The run was cancelled while a task of it ran in the worker's own process."""


HANDED_BACK = "handed_back"  # a task's result status when it stopped on its worker's stop request


class Stopping(Exception):
    """The worker was asked to stop (SIGTERM) while a task of it ran: the task stores what it has
    done, lets go of its leases and returns HANDED_BACK; the task goes back to its queue at once.
    `counted`: whether the hand-back is one of the task's HAND_BACKS (eyrie.work.queue); a wait for
    the GPUs handed back is not (eyrie.work.gpu_wait.WaitingForGpus)."""

    counted = True


STOP_REQUESTED = threading.Event()  # this process's worker was asked to stop (SIGTERM)


def stop_requested() -> bool:
    """Whether this process's task was asked to stop: its worker's SIGTERM (a GPU stage's worker
    runs its tasks in its own process; the generator's forwards it to its work horse). A task
    that sees it stores what it has done and hands the rest back (Stopping); Redis commands stop
    waiting out an away Redis (eyrie.work.queue), so that the stop ends within its bound."""
    return STOP_REQUESTED.is_set()


class CancelWatch:
    """Whether the run has been cancelled, asked of Redis at most every `every_s`: tasks that run
    in the worker process (extract, train) poll it between batches or steps and stop cleanly."""

    def __init__(self, conn, run: str, every_s: float = 2.0):
        self.conn, self.run, self.every_s = conn, run, every_s
        self.seen, self._asked = False, 0.0

    def __call__(self) -> bool:
        if not self.seen and time.monotonic() - self._asked >= self.every_s:
            self._asked = time.monotonic()
            # a cancel that a start is lifting (eyrie.runs.restart) stops nothing its planning enqueues
            self.seen = bool(self.conn.exists(keys.cancelled(self.run))) and not self.conn.exists(
                keys.restarting(self.run))
        return self.seen


def block(conn, run: str, exc) -> None:
    """A refusal the user must fix (storage budget, a base drafter that does not fit): no retry,
    shown by status until `eyrie run` is run again. `exc`: the EyrieError, kept as its text."""
    logging.getLogger("eyrie.runs.pipeline").warning("run %s: the next stage did not start: %s", run, exc)
    conn.set(keys.blocked(run), str(exc))
