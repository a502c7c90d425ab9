"""The task side of a stage with one task per shard (generate, extract): the skeleton they share.

A shard's records (one per sample, keyed by `sample_id`) go to the store in parts as the work
proceeds (eyrie.data.partlog), so a retried task reads them back and does only what is missing; its
counts of done, skipped and failed records are its live progress; its shard manifest
(eyrie.data.manifest.ShardManifest), the proof of completion, is written last, where the done-check
looks, and then the parts are removed. A subclass holds only its own work: the records it makes
(`_add` each), its counts' and its manifest's own fields, and what its result adds.

The constructor reads nothing: the run manifest is read on first use, under the task's lease."""

from __future__ import annotations

import socket
import time
from collections import Counter
from functools import cached_property

from eyrie.data.manifest import Counts, Layout, RunManifest, ShardManifest, load_run_manifest, now_iso, outcomes
from eyrie.data.partlog import PartLog
from eyrie.tasks.executor import Context, ShardTask, StageTask


class ShardedStageTask(StageTask):
    """One shard of a sharded stage; `records` by sample id, `pending` those not yet in a part."""

    Payload = ShardTask

    def __init__(self, ctx: Context, payload: ShardTask):
        super().__init__(ctx, payload)
        self.layout = Layout(self.run_name)
        self.parts = PartLog(self.store, self.layout.parts(self.stage.name, self.shard))
        self.records: dict[str, dict] = {}
        self.pending: list[dict] = []

    @cached_property
    def manifest(self) -> RunManifest:
        """The run manifest, read on first use (never by the constructor, before the done-check)."""
        return load_run_manifest(self.store, self.run_name)

    def done_key(self) -> str:
        return self.layout.shard_manifest(self.stage.name, self.shard)

    def report_waiting(self, what: str) -> None:
        self._report(waiting_for=what)

    def resume(self) -> None:
        """This attempt begins: the records an earlier attempt stored in parts are read back."""
        self.started_at, self._t0 = now_iso(), time.monotonic()
        for record in self.parts.load():
            self.records.setdefault(record["sample_id"], record)

    def _add(self, record: dict) -> None:
        self.records[record["sample_id"]] = record
        self.pending.append(record)

    def _take_part(self) -> tuple[str, bytes] | None:
        """The pending records as the next part (its key, its bytes); None when none is pending."""
        if not self.pending:
            return None
        key, data = self.parts.take_key(), self.parts.encode(self.pending)
        self.pending = []
        return key, data

    def _flush(self) -> None:
        """The pending records to the store as the next part."""
        part = self._take_part()
        if part is not None:
            self.store.put_bytes(*part)

    def count_fields(self) -> dict:
        """The stage's own fields of its counts (`total` among them)."""
        raise NotImplementedError

    def _counts(self) -> Counts:
        statuses = Counter(r["status"] for r in self.records.values())
        return Counts(done=statuses["done"], skipped=statuses["skipped"], failed=statuses["failed"],
                      **self.count_fields())

    def progress_fields(self) -> dict:
        """The stage's own fields of its live progress, beside its counts."""
        return {}

    def _report(self, final: bool = False, waiting_for: str | None = None) -> None:
        self.progress.report(**self._counts().model_dump(), **self.progress_fields(), final=final,
                             waiting_for=waiting_for)

    def manifest_fields(self, records: list[dict], counts: Counts) -> dict:
        """The stage's own fields of its shard manifest (`bytes` among them), from its records in
        row order; what the stage writes beside the manifest, it writes here."""
        raise NotImplementedError

    def result_fields(self, counts: Counts, wall: float) -> dict:
        """The stage's own fields of its result."""
        return {}

    def _finish(self) -> dict:
        """Every record is in: the shard manifest (last), the parts removed, the final progress."""
        records = sorted(self.records.values(), key=lambda r: r["row"])
        counts = self._counts()
        own = self.manifest_fields(records, counts)
        shard_manifest = ShardManifest(
            run=self.run_name, stage=self.stage.name, shard=self.shard, counts=counts, **outcomes(records),
            started_at=self.started_at, finished_at=now_iso(), worker=socket.gethostname(), **own)
        self.write_manifest(shard_manifest)
        self.parts.clear()
        self._report(final=True)
        wall = max(1e-9, time.monotonic() - self._t0)
        return self.result("done", **counts.model_dump(), wall_s=round(wall, 3), **self.result_fields(counts, wall))
