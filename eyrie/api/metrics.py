"""/metrics: a Prometheus collector that reads Redis and each run's status at scrape time."""

from __future__ import annotations

from collections import Counter

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from eyrie.core.errors import UnknownRun
from eyrie.runs.control import run_names
from eyrie.runs.status import overall_state, run_status
from eyrie.stages import queues
from eyrie.work import gpu
from eyrie.work.queue import queue, task_counts, workers_on
from eyrie.work.status_models import RunStatus, StageStatus, TrainStatus

RUN_STATES = ("pending", "in_progress", "done", "failed", "cancelled")


class EyrieCollector:
    def __init__(self, conn, store):
        self.conn, self.store = conn, store

    def collect(self):
        yield from self._queues()
        yield self._lease()
        yield from self._runs()

    def _queues(self):
        jobs = GaugeMetricFamily("eyrie_queue_jobs", "Tasks per queue and state.", labels=["queue", "state"])
        workers = GaugeMetricFamily("eyrie_workers", "Workers listening on a stage's queue.", labels=["queue"])
        for stage in queues():
            failed = queue(self.conn, stage).failed_job_registry.count
            for state, count in {**task_counts(self.conn, stage), "failed": failed}.items():
                jobs.add_metric([stage, state], count)
            workers.add_metric([stage], workers_on(self.conn, stage))
        yield jobs
        yield workers

    def _lease(self):
        lease = GaugeMetricFamily("eyrie_gpu_lease_held", "1 while the owner holds a GPU lease (one per device set).",
                                  labels=["owner", "devices"])
        held = Counter((h["owner"], str(h.get("devices", ""))) for h in (gpu.leases(self.conn) or {}).get("holders", []))
        for labels, count in sorted(held.items()):
            lease.add_metric(list(labels), count)
        return lease

    def _runs(self):
        families = _run_families()
        for run in run_names(self.conn):
            try:
                status = run_status(self.conn, self.store, run)
            except UnknownRun:
                continue
            state = overall_state(status)
            for value in RUN_STATES:
                families["state"].add_metric([run, value], 1 if state == value else 0)
            for stage, s in status.stages.items():
                _stage_metrics(families, run, stage, s)
            _acceptance(families["acceptance"], run, status)
        yield from families.values()


def _run_families() -> dict[str, GaugeMetricFamily]:
    rs = ["run", "stage"]
    return {
        "state": GaugeMetricFamily("eyrie_run_state", "1 for the run's current state.", labels=["run", "state"]),
        "samples": GaugeMetricFamily("eyrie_samples", "Samples per stage by outcome (train: steps).",
                                     labels=[*rs, "outcome"]),
        "tokens": GaugeMetricFamily("eyrie_tokens", "Tokens processed per stage.", labels=rs),
        "tok_per_s": GaugeMetricFamily("eyrie_tokens_per_second", "Tokens per second of a stage.", labels=rs),
        "in_flight": GaugeMetricFamily("eyrie_requests_in_flight", "Requests in flight (generate).", labels=rs),
        "bytes": GaugeMetricFamily("eyrie_bytes_stored", "Bytes a stage has stored.", labels=rs),
        "eta": GaugeMetricFamily("eyrie_eta_seconds", "Estimated seconds left in a stage.", labels=rs),
        "failures": GaugeMetricFamily("eyrie_task_failures", "A stage's tasks that failed for good.", labels=rs),
        "acceptance": GaugeMetricFamily("eyrie_acceptance_length", "The exported drafter's acceptance length "
                                        "(tokens per target forward): eyrie's simulation or vLLM's.",
                                        labels=["run", "source"]),
    }


def _acceptance(family: GaugeMetricFamily, run: str, status: RunStatus) -> None:
    trained = [s for s in status.stages.values() if isinstance(s, TrainStatus)]
    drafter, verified = ((trained[0].drafter, trained[0].verify) if trained else (None, None))
    for source, record, key in (("eyrie", drafter, "tau"), ("vllm", verified, "vllm_acceptance_length")):
        if isinstance((record or {}).get(key), (int, float)):
            family.add_metric([run, source], record[key])


def _stage_metrics(families: dict, run: str, stage: str, s: StageStatus) -> None:
    labels = [run, stage]
    for outcome in ("total", "done", "skipped", "failed"):
        families["samples"].add_metric([*labels, outcome], getattr(s, outcome))
    families["tokens"].add_metric(labels, s.tokens)
    families["tok_per_s"].add_metric(labels, s.tok_per_s or 0)
    families["in_flight"].add_metric(labels, s.in_flight)
    families["bytes"].add_metric(labels, s.bytes)
    if s.eta_s is not None:
        families["eta"].add_metric(labels, s.eta_s)
    families["failures"].add_metric(labels, s.jobs.get("failed", 0))


def metrics_response(conn, store) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EyrieCollector(conn, store))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
