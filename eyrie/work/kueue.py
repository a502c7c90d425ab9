"""Kueue's side of GPU admission (EYRIE_GPU_SCHEDULER=kueue, Kubernetes): a run's Job per GPU
stage, created when the stage's tasks are enqueued (eyrie.work.queue calls `dispatch` on every
enqueue), which drains the stage's queue and exits, freeing the quota for the next stage or the
next run. Kueue decides when it starts. Under redis (the default) `dispatch` does nothing: the
stage's workers run all the time and wait for the lease (eyrie.tasks.gpu_admission).

A run that trains on demand (extract.storage hybrid or online) reads the vLLM extraction server
until its drafter is trained: its train tasks need that server's Job too, and the server goes
when the train queue drains, not the extract queue."""

from __future__ import annotations

import time

from eyrie.core.config import Settings, load_settings, one_setting
from eyrie.core.errors import EyrieError, UnknownRun
from eyrie.core.storage import trains_on_demand
from eyrie.data.manifest import load_run_manifest
from eyrie.data.store import open_store
from eyrie.work import k8s_jobs, keys, task_kinds


class KueueAdmission:
    """Creates a run's Job for a GPU stage and follows it; Kueue decides when it starts."""

    def __init__(self, settings: Settings, client: k8s_jobs.KubeClient | None = None):
        self.templates = k8s_jobs.load_templates(settings.kueue_jobs_file)
        self.client = client or k8s_jobs.KubeClient(settings.kubernetes_api, settings.kubernetes_namespace)

    def dispatch(self, conn, job_stage: str, run: str) -> str | None:
        """The name of the run's pending or running Job for the stage, created if there is none.
        None where the chart renders no template for the stage (e.g. an external server)."""
        if job_stage not in self.templates.get("stages", {}):
            return None
        # one creator at a time: the last tasks of a stage finish on several workers at once
        with conn.lock(keys.admit_lock(job_stage, run), timeout=60, blocking_timeout=60):
            for job in self.jobs(job_stage, run):
                if k8s_jobs.job_state(job) in ("waiting", "running"):
                    return job["metadata"]["name"]
            created = self.client.create_job(k8s_jobs.build_job(self.templates, job_stage, run))
            return created["metadata"]["name"]

    def jobs(self, job_stage: str | None = None, run: str | None = None) -> list[dict]:
        selector = [f"{k8s_jobs.STAGE_LABEL}={job_stage}" if job_stage else k8s_jobs.STAGE_LABEL]
        if run:
            selector.append(f"{k8s_jobs.RUN_LABEL}={k8s_jobs.run_label(run)}")
        return self.client.list_jobs(",".join(selector))

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = 10.0) -> str:
        """Block until the Job has succeeded or failed; returns which."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (state := k8s_jobs.job_state(self.client.get_job(name))) in ("waiting", "running"):
            if deadline is not None and time.monotonic() > deadline:
                raise EyrieError(f"Job {name} is still {state} after {timeout_s:g} s.",
                                 "see `kubectl get workloads` (Kueue's queue) and the Job's pods.")
            time.sleep(poll_s)
        return state


def dispatch(conn, queue_stage: str, run: str) -> list[str]:
    """Called whenever tasks of a stage are enqueued: the names of the run's Jobs that serve them.
    Under the Redis lease (the default) it does nothing and reads one setting alone
    (Settings.gpu_scheduler: every enqueue asks)."""
    if one_setting("gpu_scheduler") != "kueue" or not task_kinds.jobs_for_queue(queue_stage):
        return []
    settings = load_settings()
    admission = KueueAdmission(settings)
    names = (admission.dispatch(conn, job_stage, run) for job_stage in run_jobs(settings, queue_stage, run))
    return [name for name in names if name]


def run_jobs(settings: Settings, queue_stage: str, run: str) -> tuple[str, ...]:
    """The Jobs a run's tasks of a queue need, in creation order (eyrie.work.task_kinds.jobs_for_queue):
    the vLLM extraction server before the trainer of a run that trains on demand."""
    return task_kinds.jobs_for_queue(queue_stage, run_trains_on_demand(settings, run))


def servers_done(settings: Settings, queue_stage: str, run: str) -> tuple[str, ...]:
    """The server Jobs of a run no task needs once the queue has drained (eyrie.work.task_kinds.servers_done)."""
    return task_kinds.servers_done(queue_stage, run_trains_on_demand(settings, run))


def run_trains_on_demand(settings: Settings, run: str) -> bool:
    """extract.storage hybrid or online, from the run's manifest in the store (a run without one
    has nothing to train: its task says so itself)."""
    try:
        return trains_on_demand(load_run_manifest(open_store(settings), run))
    except UnknownRun:
        return False
