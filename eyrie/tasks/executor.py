"""One executor for every stage task: the done-check, the task lease and its heartbeat, the GPU
lease, the cancel check, live progress and the manifest's place; a stage class holds its own work.

A stage is a `StageTask` subclass: its row in eyrie.stages, its payload model, where its output's
manifest goes (the done-check), the devices it computes on (the GPU lease) and `run`. `execute`
runs one task of it the same way from an RQ task function (`run_extract_shard(payload)` is
`execute(ExtractRunner, payload)`), a container (`python -m eyrie.tasks.executor extract '{"run": ...}'`)
or in-process (`execute(ExtractRunner, payload, Context(settings, conn, store))`).

Exactly-once: a task whose manifest is in the store returns at once; otherwise it runs only under
its task lease (a dead holder's lapses within LEASE_TTL_S), renewed by a heartbeat through the
wait for the GPU, model loads and the work; its manifest is written last, where the done-check
looks."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from eyrie.core.config import Settings, load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.run_config import RUN_NAME
from eyrie.data.store import open_store
from eyrie.stages import TaskKind, entry, task_kinds
from eyrie.tasks.gpu_admission import acquire_within, gpu_lease
from eyrie.work import progress
from eyrie.work.cancel import HANDED_BACK, Cancelled, CancelWatch, Stopping
from eyrie.work.gpu import in_mode
from eyrie.work.queue import Heartbeat, connect, held_task
from eyrie.work.worker_loop import stop_requested


class RunTask(BaseModel):
    """The JSON payload of a task of one run (validated before anything runs)."""

    model_config = ConfigDict(extra="forbid")
    run: str = Field(pattern=RUN_NAME.pattern)


class ShardTask(RunTask):
    """The JSON payload of a task of one shard of a run."""

    shard: int = Field(ge=0)


@dataclass(frozen=True)
class Context:
    """What a stage works with: the settings, Redis and the store."""

    settings: Settings
    conn: Any  # redis.Redis
    store: Any  # eyrie.data.store.Store

    @classmethod
    def from_env(cls) -> "Context":
        settings = load_settings()
        return cls(settings, connect(settings.redis_url), open_store(settings))


class Live:
    """A task's live progress in Redis (eyrie.work.progress): its worker, when this attempt began, and
    the stage's own fields. The store stays the record."""

    def __init__(self, conn, run: str, stage: str, task: str):
        self.conn, self.run, self.stage, self.task = conn, run, stage, task
        self.started = time.time()

    def report(self, **fields) -> None:
        progress.report(self.conn, self.run, self.stage, self.task, self.started,
                        worker=socket.gethostname(), **fields)

    def curve(self, data: dict) -> None:
        progress.report_curve(self.conn, self.run, self.stage, data)


class StageTask:
    """One task of a stage: its own work. A subclass sets `stage` and `Payload` and defines `run`;
    while `run` runs, `lease` (the task lease), `beat` (its heartbeat; `beat.lost`: another worker
    took the task over) and `gpu` (the GPU lease, if `devices` named any) are held for it."""

    stage: ClassVar[TaskKind]
    Payload: ClassVar[type[RunTask]] = RunTask
    gpu_owner: ClassVar[str] = ""  # the GPU lease's holder in status: "<gpu_owner>@<host>"
    gpu_caches: ClassVar[tuple] = ()  # functools caches of models on the device, emptied before the GPU lease goes

    def __init__(self, ctx: Context, payload: RunTask):
        self.ctx, self.payload = ctx, payload
        self.settings, self.conn, self.store = ctx.settings, ctx.conn, ctx.store
        self.run_name, self.shard = payload.run, getattr(payload, "shard", 0)
        self.task = self.stage.task_id(self.run_name, self.shard)
        self.progress = Live(ctx.conn, self.run_name, self.stage.name, str(self.shard))
        self.cancelled = CancelWatch(ctx.conn, self.run_name)
        self.lease = self.beat = self.gpu = None

    def recover(self) -> None:
        """Before the done-check: what a dead earlier attempt left behind (nothing by default)."""

    def done_key(self) -> str | None:
        """The store key of its output's manifest: once it exists the task is done. None: no check."""
        return None

    def devices(self) -> str | None:
        """The devices it computes on under the GPU lease; None when it needs no GPU lease."""
        return None

    def gpu_mode(self) -> str:
        """How its GPU lease shares (eyrie.work.gpu): "own" unless a subclass says otherwise."""
        return "own"

    def report_waiting(self, what: str) -> None:
        """Show in live progress what it waits for (the GPU lease)."""

    def run(self) -> dict:
        raise NotImplementedError

    def stop_if_asked(self) -> None:
        """Ends a wait (for the GPUs, for a server): Cancelled when the run is cancelled, Stopping when
        its worker is asked to stop (SIGTERM)."""
        if self.cancelled():
            raise Cancelled(self.run_name)
        if stop_requested():
            raise Stopping(f"the worker is stopping while {self.task} waited")

    def on_cancel(self) -> dict:
        """The result when `run` raised `Cancelled`: what is stored stays, a retry goes on from there."""
        return self.result("cancelled")

    def result(self, status: str, **fields) -> dict:
        ident = {"shard": self.shard} if isinstance(self.payload, ShardTask) else {}
        return {**ident, "status": status, **fields}

    def write_manifest(self, manifest: BaseModel) -> None:
        """The proof of completion, written last, where the done-check looks."""
        self.store.put_json(self.done_key(), manifest.model_dump())


def execute(stage_class: type[StageTask], payload: dict, ctx: Context | None = None) -> dict:
    """One task of a stage, from its JSON payload (validated before anything runs)."""
    checked = stage_class.Payload.model_validate(payload)
    task = stage_class(ctx or Context.from_env(), checked)
    task.recover()
    done = task.done_key()
    if done is not None and task.store.exists(done):
        return task.result("already_done")
    with held_task(task.conn, task.task) as lease:
        if lease is None:
            return task.result("held_by_another_worker")
        task.lease = lease
        try:
            with Heartbeat(lease) as task.beat:  # through the GPU wait, loading, the work itself
                return _on_device(task)
        except Cancelled:
            return task.on_cancel()
        except Stopping as stop:  # its worker was asked to stop, or its wait (GPUs, its turn) goes on in its queue
            print(f"eyrie: {task.task} handed back: {stop}", flush=True)
            return task.result(HANDED_BACK, **({} if stop.counted else {"counted": False}))


def _on_device(task: StageTask) -> dict:
    devices = task.devices()
    if devices is None:
        return task.run()
    owner = f"{task.gpu_owner}@{socket.gethostname()}"
    lease = gpu_lease(task.settings, task.conn, owner, devices, caches=task.gpu_caches)
    task.gpu = task.beat.gpu = in_mode(lease, task.gpu_mode())
    task.report_waiting("gpu_lease")
    acquire_within(task.gpu, task.settings.gpu_wait_s, stop=task.stop_if_asked)
    try:
        return task.run()
    finally:
        task.gpu.release()  # drops the stage's cached models first: the next holder needs the memory


def main(argv: list[str] | None = None) -> int:
    """One task of a stage in this process, by the stage's name (a container's command)."""
    parser = argparse.ArgumentParser(prog="python -m eyrie.tasks.executor")
    parser.add_argument("stage", choices=sorted(task_kinds()))
    parser.add_argument("payload", help='the task\'s JSON payload, e.g. \'{"run": "r1", "shard": 0}\'')
    args = parser.parse_args(argv)
    try:
        result = entry(task_kinds()[args.stage].func)(json.loads(args.payload))
    except (EyrieError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"eyrie: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
