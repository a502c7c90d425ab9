"""Kueue's side of GPU admission (EYRIE_GPU_SCHEDULER=kueue, Kubernetes): a run's Job per GPU
stage, created when the stage's tasks are enqueued (eyrie.work.queue calls `dispatch` on every
enqueue), which drains the stage's queue and exits, freeing the quota for the next stage or the
next run. Kueue decides when it starts. Under redis (the default) `dispatch` does nothing: the
stage's workers run all the time and wait for the lease (eyrie.tasks.gpu_admission)."""

from __future__ import annotations

import time

from eyrie.core.config import Settings, load_settings, one_setting
from eyrie.core.errors import EyrieError
from eyrie.work import k8s_jobs, keys
from eyrie.work.task_kinds import jobs_for_queue


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
    if one_setting("gpu_scheduler") != "kueue" or not jobs_for_queue(queue_stage):
        return []
    admission = KueueAdmission(load_settings())
    names = (admission.dispatch(conn, job_stage, run) for job_stage in jobs_for_queue(queue_stage))
    return [name for name in names if name]
