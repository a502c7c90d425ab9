"""A cancelled run started again (`eyrie run`, `eyrie <stage>`, POST /runs) keeps its cancel until the
start's planning has planned. The planning tasks that decide the start (a pipeline's base drafter
fetch, then the first stage's planner; a stage's own planner) run one after another while the run
is still cancelled, so nothing else of it starts (`advance` starts nothing for a cancelled run). A
refusal by any of them (a base drafter that does not fit, other settings than the plan) leaves the
run cancelled, and blocked with the refusal; once the last has planned, the cancel is lifted and the
pipeline goes on. Meanwhile the run's tasks do not read the cancel being lifted (eyrie.work.cancel):
a planner enqueues its work before its own result is in."""

from __future__ import annotations

from eyrie.stages import task_kinds
from eyrie.work import keys
from eyrie.work.cancel import HANDED_BACK
from eyrie.work.queue import enqueue
from eyrie.work.task_kinds import TaskKind

UNDECIDED = {HANDED_BACK, "held_by_another_worker"}  # the task runs again, or runs elsewhere: its result is to come


def hold_cancel(conn, run: str, planning: list[TaskKind]) -> bool:
    """For a start of a cancelled run: its deciding tasks recorded in order (the caller enqueues the
    first; each next one is enqueued once the one before has planned). False, nothing held: the run
    is not cancelled, or nothing plans this start (its cancel is lifted now); the caller starts them
    all at once."""
    conn.delete(keys.restarting(run))
    if not planning or not conn.exists(keys.cancelled(run)):
        conn.delete(keys.cancelled(run))  # nothing plans this start: nothing can refuse it later
        return False
    conn.rpush(keys.restarting(run), *(kind.name for kind in planning))
    return True


def pending(conn, run: str) -> list[TaskKind]:
    """The deciding tasks of the run's start still to plan, in order (the first enqueued)."""
    kinds = task_kinds()
    return [kinds[name.decode()] for name in conn.lrange(keys.restarting(run), 0, -1)]


def on_planned(conn, run: str, task_id: str, result) -> bool:
    """A task's result (its success callback): where it is the start's next deciding task, a refusal
    keeps the cancel (the start is over); a plan enqueues the next one, or lifts the cancel (True)."""
    head = pending(conn, run)[:1]
    status = result.get("status") if isinstance(result, dict) else None
    if not head or head[0].task_id(run) != task_id or status in UNDECIDED:
        return False
    if status == "refused":
        conn.delete(keys.restarting(run))
        return False
    conn.lpop(keys.restarting(run))
    following = pending(conn, run)[:1]
    if following:
        enqueue(conn, following[0], {"run": run}, at_front=True)
        return False
    conn.delete(keys.cancelled(run), keys.restarting(run))
    return True
