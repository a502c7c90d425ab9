"""One generate task: a shard of prompts answered by the target, every row accounted for.

Exactly-once: results are flushed to the store in parts as they arrive; a retried task reads
the parts back and asks only for what is missing; the finished shard is written once, then
its manifest (the proof of completion), then the parts are removed.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from eyrie.core.config import parse_endpoints
from eyrie.core.target import same_target
from eyrie.data.manifest import Counts, ShardPlan
from eyrie.data.prompts import Skip, to_turns
from eyrie.runs import serve_turns
from eyrie.stages import GENERATE
from eyrie.tasks.executor import Context, execute
from eyrie.tasks.sharded import ShardedStageTask
from eyrie.work import inference
from eyrie_generator.chain import Chain, recover_claims
from eyrie_generator.client import ChatClient, Completion
from eyrie_generator.conversation import answer_turns
from eyrie_generator.prompt_budget import PromptBudget
from eyrie_generator.tasks import GenerateTask

FLUSH_EVERY = 64
FLUSH_SECONDS = 10.0


class ShardRunner(ShardedStageTask):
    """One generate shard (the executor, eyrie.tasks.executor, holds its lease and checks for its
    manifest); its lanes go on to other queued shards of the run (eyrie_generator.chain). Its
    parts, counts and shard manifest are eyrie.tasks.sharded's; its own are the answers."""

    stage, Payload = GENERATE, GenerateTask

    def __init__(self, ctx: Context, payload: GenerateTask):
        super().__init__(ctx, payload)
        self.flushes: list[asyncio.Future] = []
        self._last_flush = time.monotonic()
        self.in_flight = 0
        self.in_flight_area = 0.0
        self._last_tick = time.monotonic()

    @property
    def plan(self) -> ShardPlan:
        return self.manifest.generate_shards[self.shard]

    def recover(self) -> None:
        recover_claims(self.conn, self.store, self.run_name, self.task)  # shards an earlier, dead attempt had taken on

    def run(self) -> dict:
        return asyncio.run(Chain(self).run())

    def for_shard(self, shard: int) -> "ShardRunner":
        """The runner of another shard of the same run, on the same context (a shard taken on)."""
        return type(self)(self.ctx, GenerateTask(run=self.run_name, shard=shard))

    def prepare(self) -> list[dict]:
        """The rows still to answer (a retried task reads its parts back first)."""
        self.resume()
        return [row for row in self._input_rows() if row["sample_id"] not in self.records]

    async def close(self) -> dict:
        """Every row has its record: the last part, then the shard and its manifest."""
        self._flush()
        await asyncio.gather(*self.flushes)
        return await asyncio.to_thread(self._finish)

    def _input_rows(self) -> list[dict]:
        raw = self.store.get_verified(self.plan.input_key, self.plan.input_sha256)
        rows = []
        for line in raw.splitlines():
            row = orjson.loads(line)
            turns = to_turns(row["data"], self.manifest.generate.turns) if row.get("skip") is None \
                else Skip(row["skip"])
            if isinstance(turns, Skip):
                rows.append({"row": row["row"], "sample_id": row["sample_id"], "skip": turns.reason})
            else:
                rows.append({"row": row["row"], "sample_id": row["sample_id"], "requests": turns})
        return rows

    def budget(self, endpoints: list[inference.Endpoint]) -> PromptBudget:
        lengths = [e.max_model_len for e in endpoints if e.max_model_len]
        target = self.manifest.target
        return PromptBudget.load(target.model, min(lengths) if lengths else None, target.trust_remote_code)

    async def answer_one(self, client: ChatClient, budget: "PromptBudget", row: dict) -> None:
        """A row's answer (every turn of its conversation, each after the one before), recorded."""
        if "skip" in row:
            return self._record(row, {"messages": None, **Completion("skipped", reason=row["skip"]).__dict__})

        async def ask(messages: list[dict]) -> Completion:
            max_tokens = budget.max_tokens(messages, self.manifest.generate.sampling.max_tokens)
            if isinstance(max_tokens, Skip):
                return Completion("skipped", reason=max_tokens.reason)
            self._tick(+1)
            try:
                return await client.complete(messages, max_tokens)
            finally:
                self._tick(-1)

        self._record(row, await answer_turns(row["requests"], ask))

    def _tick(self, delta: int) -> None:
        now = time.monotonic()
        self.in_flight_area += self.in_flight * (now - self._last_tick)
        self._last_tick, self.in_flight = now, self.in_flight + delta

    def endpoints(self) -> list[inference.Endpoint]:
        if self.settings.inference_url:
            return [inference.Endpoint(name=url, url=url, model=self.manifest.target.model, weight=weight,
                                       server=self.manifest.target.server, state="ready",
                                       max_model_len=self.settings.max_model_len)
                    for url, weight in parse_endpoints(self.settings.inference_url)]
        target = self.manifest.target
        # visible in `eyrie status` while its server loads, or while only other targets are served
        self._report(waiting_for=f"a server for target {target.model}")
        return inference.wait_serving(self.conn, self.settings.serve_deadline_s, lambda e: same_target(target, e),
                                      target.model, gpu_wait_s=self.settings.gpu_wait_s, stop=self.stop_if_asked,
                                      holder=self._turn_held_by)

    def _turn_held_by(self) -> str | None:
        """The run whose generation holds the stack's inference server while this run waits its turn
        (eyrie.runs.serve_turns), said in its live progress."""
        held_by = serve_turns.holder(self.conn, self.store, self.run_name, self.manifest.target)
        if held_by is not None:
            self._report(waiting_for=serve_turns.turn_text(held_by))
        return held_by

    def _record(self, row: dict, fields: dict) -> None:
        self._add({"sample_id": row["sample_id"], "row": row["row"], **fields})
        if len(self.pending) >= FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        """Write the pending records as the next part, off the event loop (an S3 PUT takes tens
        of ms; the requests in flight must not wait for it)."""
        for flush in self.flushes:
            if flush.done() and flush.exception():
                raise flush.exception()  # the store failed: the task fails and is retried
        part = self._take_part()
        if part is None:
            return
        self._last_flush = time.monotonic()
        self.flushes.append(asyncio.ensure_future(asyncio.to_thread(self.store.put_bytes, *part)))

    def flush_if_stale(self) -> None:
        if self.pending and time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self._flush()

    def progress_fields(self) -> dict:
        return {"in_flight": self.in_flight}

    def count_fields(self) -> dict:
        records = self.records.values()
        prompt = sum((r.get("usage") or {}).get("prompt_tokens", 0) or 0 for r in records)
        completion = sum((r.get("usage") or {}).get("completion_tokens", 0) or 0 for r in records)
        return {"total": self.plan.row_end - self.plan.row_start, "prompt_tokens": prompt,
                "completion_tokens": completion, "tokens": completion}

    def manifest_fields(self, records: list[dict], counts: Counts) -> dict:
        """The shard itself, every row's record in row order, stored ahead of its manifest."""
        expected = self.plan.row_end - self.plan.row_start
        if len(records) != expected:
            raise RuntimeError(f"shard {self.shard}: {len(records)} records for {expected} rows")
        data = b"".join(orjson.dumps(r) + b"\n" for r in records)
        info = self.store.put_bytes(self.layout.generate_shard(self.shard), data)
        return {"object": info.key, "sha256": info.sha256, "bytes": info.size}

    def result_fields(self, counts: Counts, wall: float) -> dict:
        self._tick(0)
        return {"mean_in_flight": round(self.in_flight_area / wall, 2)}


def run_generate_shard(payload: dict) -> dict:
    """RQ entry point."""
    return execute(ShardRunner, payload)
