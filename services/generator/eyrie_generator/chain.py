"""C requests in flight across shards: a worker's C lanes move on to the next queued shard of the
same run as soon as the current shard has no row left to ask for, while its last answers arrive.

Exactly-once stays per shard: a shard taken on is removed from the queue (LREM: one taker only),
held under its own task lease (renewed by the task's heartbeat, eyrie.work.queue.Heartbeat, lapsing
if this worker dies), marked started, and
written as its own shard with its own manifest. The shards a task took on are listed in Redis under
that task; if the worker dies, the task is requeued (its alive key lapses) and, first thing,
requeues every listed shard without a manifest, whose lease has lapsed by then."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.data.manifest import Layout
from eyrie.stages import GENERATE
from eyrie.work import keys
from eyrie.work.cancel import Stopping
from eyrie.work.queue import enqueue, queue, task_lease
from eyrie.work.worker_loop import stop_requested
from eyrie_generator.client import ChatClient, ServerGate

STOP_POLL_S = 0.2  # how soon the lanes see their worker's stop request


def recover_claims(conn, store, run: str, task: str) -> int:
    """Requeue the shards an earlier attempt of `task` took on and did not finish (once their
    leases, renewed by that dead attempt, have lapsed)."""
    requeued = 0
    for raw in conn.smembers(keys.generate_claims(task)):
        shard = int(raw)
        claimed = GENERATE.task_id(run, shard)
        if store.exists(Layout(run).generate_shard_manifest(shard)):
            continue
        lease = task_lease(conn, claimed)
        if lease.acquire(blocking=True):  # waits out a dead holder's lease (LEASE_TTL_S)
            release(lease)
            requeued += enqueue(conn, GENERATE, {"run": run, "shard": shard}, shard)
    conn.delete(keys.generate_claims(task))
    return requeued


class Chain:
    """One task's lanes over its own shard, then over every shard it can take on. Its rows are
    read in `run`, not here."""

    def __init__(self, first):
        self.first, self.conn, self.beat = first, first.conn, first.beat
        self.todo: list[dict] = []
        self.current, self.rows = first, iter(self.todo)
        self.leases = {}  # the shards taken on (the first one's lease is the executor's)
        self.outstanding = {first.shard: 0}
        self.closing: list[asyncio.Task] = []
        self.results: list[dict] = []
        self.claim_lock = asyncio.Lock()
        self.in_flight, self.in_flight_area, self._last_tick = 0, 0.0, time.monotonic()
        self.active = {first.shard: first}
        self.no_more = False
        self.gates: list[ServerGate] = []

    async def run(self) -> dict:
        self.todo = self.first.prepare()
        self.rows = iter(self.todo)
        t0 = time.monotonic()
        reporter = asyncio.create_task(self._report_loop())
        try:
            if any("requests" in row for row in self.todo):
                await self._answer()
            else:  # nothing to ask (every row skipped): no server needed, no other shard taken on
                for row in self.todo:
                    await self.first.answer_one(None, None, row)
                self._close(self.first)
            await asyncio.gather(*self.closing)
        finally:
            reporter.cancel()
            await self._store_answered()
            for lease in self.leases.values():
                self._release(lease)
            # all done: only forgets the list; after an error, requeues what was taken on and not done
            recover_claims(self.conn, self.first.store, self.first.run_name, self.first.task)
        own = next(r for r in self.results if r["shard"] == self.first.shard)
        wall = max(1e-9, time.monotonic() - t0)
        return {**own, "wall_s": round(wall, 3), "mean_in_flight": round(self.in_flight_area / wall, 2),
                "chained_shards": [r["shard"] for r in self.results if r["shard"] != self.first.shard],
                "chained_done": sum(r["done"] for r in self.results if r["shard"] != self.first.shard)}

    async def _answer(self) -> None:
        first = self.first
        endpoints = first.endpoints()
        params = first.manifest.generate
        budget = first.budget(endpoints)
        connector = aiohttp.TCPConnector(limit=params.concurrency, limit_per_host=params.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.gates = [ServerGate(session, e.url, first.settings.serve_deadline_s, stop=first.stop_if_asked)
                          for e in endpoints]
            clients = [ChatClient(session, e.url, e.model, e.server, params.sampling.model_dump(),
                                  params.request_timeout_s, params.max_retries,
                                  (params.think_start, params.think_end), params.retry_backoff_s, gate)
                       for e, gate in zip(endpoints, self.gates)]

            async def lane(client: ChatClient) -> None:
                while (item := await self._next()) is not None:
                    runner, row = item
                    self._tick(+1)
                    try:
                        await runner.answer_one(client, budget, row)
                    finally:
                        self._tick(-1)
                    self._answered(runner)

            shares = split_lanes(params.concurrency, [e.weight for e in endpoints])
            await self._all_lanes([lane(c) for c, n in zip(clients, shares) for _ in range(n)])
        if self.outstanding.get(self.current.shard) == 0 and self.current.shard in self.active:
            self._close(self.current)  # a shard with no row to ask (all done by an earlier attempt)

    async def _all_lanes(self, lanes: list) -> None:
        """Every lane to its end. On a lane's error, or on a stop request (SIGTERM), the other lanes
        are cancelled, their requests in flight, waits and retries included (the shard's next taker
        asks them again): then the error, or Stopping, is raised."""
        async def stop_asked() -> None:
            while not stop_requested():
                await asyncio.sleep(STOP_POLL_S)
            raise Stopping(f"the worker is stopping; shard(s) {', '.join(map(str, self.active))} keep what "
                           "was answered (stored), the rest is asked by the next worker")

        tasks, watch = [asyncio.ensure_future(lane) for lane in lanes], asyncio.ensure_future(stop_asked())
        ended = asyncio.ensure_future(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION))
        try:
            await asyncio.wait({ended, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (ended, watch, *tasks):
                task.cancel()
            await asyncio.gather(ended, watch, *tasks, return_exceptions=True)
        for task in (watch, *tasks):  # the stop first, else the first lane's error
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _store_answered(self) -> None:
        """On the way out early (a stop, an error): the shards being closed finish, and each other
        shard's answered records go to the store as a part, so its next taker asks only the rest."""
        await asyncio.gather(*self.closing, return_exceptions=True)
        for runner in list(self.active.values()):
            try:
                runner._flush()
            except Exception:  # an earlier part failed to store: those records are asked again
                pass
            await asyncio.gather(*runner.flushes, return_exceptions=True)

    async def _next(self):
        """The next row to ask for: the current shard's, else the next shard taken on."""
        while True:
            row = next(self.rows, None)
            if row is not None:
                self.outstanding[self.current.shard] += 1
                return self.current, row
            seen = self.current
            async with self.claim_lock:
                if self.current is not seen:
                    continue  # another lane took on the next shard meanwhile
                if self.no_more:
                    return None
                taken = await asyncio.to_thread(self._take_next)
                if self.outstanding[seen.shard] == 0 and seen.shard in self.active:
                    self._close(seen)
                if taken is None:
                    self.no_more = True
                    return None

    def _take_next(self):
        """Take on the next queued shard of the run (None when there is none): out of the queue,
        under its lease, listed under this task, marked started; then its rows to ask for."""
        first, q = self.first, queue(self.conn, GENERATE.queue)
        if first.cancelled():
            return None  # a cancelled run's shards stay where the cancel left them
        for plan in first.manifest.generate_shards:
            job_id = GENERATE.task_id(first.run_name, plan.index)
            if plan.index in self.outstanding:
                continue
            self.conn.sadd(keys.generate_claims(first.task), plan.index)  # listed first: a death in between loses nothing
            if not q.remove(job_id):
                self.conn.srem(keys.generate_claims(first.task), plan.index)
                continue  # not waiting in the queue (done, running, scheduled)
            lease = task_lease(self.conn, job_id)
            if not lease.acquire(blocking=False):  # renewed by self.beat from here on
                q.push_job_id(job_id)  # another holder (a dead worker's lease not yet lapsed): leave it
                self.conn.srem(keys.generate_claims(first.task), plan.index)
                continue
            job = Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer)
            if first.store.exists(first.layout.generate_shard_manifest(plan.index)):
                job.set_status(JobStatus.FINISHED)  # a duplicate of a finished task: nothing to do
                release(lease)
                self.conn.srem(keys.generate_claims(first.task), plan.index)
                continue
            job.set_status(JobStatus.STARTED)
            runner = first.for_shard(plan.index)
            # that task's own earlier attempt may have died on shards it had taken on: requeue them
            recover_claims(self.conn, first.store, first.run_name, job_id)
            rows = runner.prepare()
            self.beat.hold(lease)
            self.leases[plan.index], self.outstanding[plan.index] = lease, 0
            self.active[plan.index] = runner
            self.current, self.rows = runner, iter(rows)
            return runner
        return None

    def _answered(self, runner) -> None:
        self.outstanding[runner.shard] -= 1
        if self.outstanding[runner.shard] == 0 and runner is not self.current and runner.shard in self.active:
            self._close(runner)

    def _close(self, runner) -> None:
        del self.active[runner.shard]
        self.closing.append(asyncio.create_task(self._finish(runner)))

    async def _finish(self, runner) -> None:
        result = await runner.close()
        self.results.append(result)
        if runner is not self.first:
            job = Job.fetch(runner.task, connection=self.conn, serializer=JSONSerializer)
            job.set_status(JobStatus.FINISHED)
            self._release(self.leases.pop(runner.shard))

    def _tick(self, delta: int) -> None:
        now = time.monotonic()
        self.in_flight_area += self.in_flight * (now - self._last_tick)
        self._last_tick, self.in_flight = now, self.in_flight + delta

    def _release(self, lease) -> None:
        self.beat.drop(lease)
        release(lease)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            waiting = "; ".join(filter(None, (gate.waiting_for() for gate in self.gates))) or None
            for runner in list(self.active.values()):
                runner._report(waiting_for=waiting)
                runner.flush_if_stale()


def split_lanes(concurrency: int, weights: list[int]) -> list[int]:
    """C lanes over the endpoints in proportion to their weights (largest remainder), at least one
    each while there are lanes enough."""
    total = sum(weights)
    exact = [concurrency * w / total for w in weights]
    lanes = [max(1, int(x)) if concurrency >= len(weights) else int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(lanes) < concurrency:
        lanes[by_remainder[i % len(lanes)]] += 1
        i += 1
    while sum(lanes) > concurrency:
        lanes[max(range(len(lanes)), key=lambda j: lanes[j] - exact[j])] -= 1
    return lanes


def release(lease) -> None:
    import redis

    try:
        lease.release()
    except redis.exceptions.LockError:
        pass
