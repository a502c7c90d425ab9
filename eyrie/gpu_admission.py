"""Who may use the GPUs now, behind one interface: the Redis leases per device set (Compose, and
hosts sharing one Redis), or Kueue's admission of a Job per GPU stage on Kubernetes.
EYRIE_GPU_SCHEDULER picks one.

Stages ask `gpu_lease(settings, conn, owner, devices)` for a lease (acquire, renew, release):
- redis: eyrie.gpu.GpuLease: a lease per (host, GPU) in Redis sequences serve, extract and train
  on the same GPUs; disjoint GPUs, or other hosts, run side by side (EYRIE_GPU_HOST, EYRIE_GPU_IDS).
- kueue: the pod runs only once Kueue has admitted its Job within the ClusterQueue's quota, so
  the GPUs it requested are its own: the lease is granted at once.

Enqueueing a GPU stage's tasks calls `dispatch`: nothing under redis (the stage's workers run
all the time and wait for the lease); under kueue it creates the stage's Job for the run (once
while one is pending or running), which drains the stage's queue and exits, freeing the quota
for the next stage or the next run.

    python -m eyrie.gpu_admission drain extract      # the command of a GPU Job's container
    python -m eyrie.gpu_admission job train --run r1 --wait
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from eyrie import gpu, k8s_jobs, keys
from eyrie.config import Settings, load_settings
from eyrie.errors import EyrieError
from eyrie.queue import connect, queue, run_worker
from eyrie.stages import GPU_QUEUES

SCHEDULERS = ("redis", "kueue")


class Admitted:
    """The lease of a pod Kueue admitted: its GPUs are its own for as long as it runs."""

    def __init__(self, owner: str, devices: str = "all", caches: tuple = ()):
        self.owner, self.devices, self.caches = owner, devices, caches

    def acquire(self, wait_s: float | None = None, poll_s: float = 1.0) -> bool:
        return True

    def held(self) -> bool:
        return True

    def renew(self) -> None:
        pass

    def release(self) -> None:
        gpu.free_device_memory(*self.caches)  # the pod may go on to another stage's task


def gpu_lease(settings: Settings, conn, owner: str, devices: str = "all", caches: tuple = ()):
    """The lease a stage holds while it uses the GPUs; `caches` (models on the device) are
    emptied before it goes."""
    if settings.gpu_scheduler == "kueue":
        return Admitted(owner, devices, caches)
    return gpu.GpuLease(conn, owner, devices, caches=caches, host=settings.gpu_host, gpu_ids=settings.gpu_ids)


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
    Under the Redis lease (the default) it does nothing and reads nothing beyond one variable."""
    if os.environ.get("EYRIE_GPU_SCHEDULER", "redis") != "kueue" or queue_stage not in k8s_jobs.JOBS_FOR_QUEUE:
        return []
    admission = KueueAdmission(load_settings())
    names = (admission.dispatch(conn, job_stage, run) for job_stage in k8s_jobs.JOBS_FOR_QUEUE[queue_stage])
    return [name for name in names if name]


def drain(conn, stage: str, poll_s: float = 5.0) -> None:
    """Work a stage's queue until nothing is queued or waiting for a retry, then return: the Job
    completes and Kueue hands its quota on."""
    q = queue(conn, stage)
    while True:
        run_worker(conn, stage, burst=True)
        if q.count + q.scheduled_job_registry.count + q.deferred_job_registry.count == 0:
            return
        time.sleep(poll_s)


def resume_waiting(conn) -> list[str]:
    """Once a GPU Job's work is done: the Jobs of every run whose tasks still wait in a queue (a
    server admitted while another run's later stages waited hands its GPUs back at once, and is
    created again here)."""
    names = []
    for queue_stage in k8s_jobs.JOBS_FOR_QUEUE:
        runs = {job.args[0].get("run") for job in queue(conn, queue_stage).get_jobs() if job and job.args}
        for run in sorted(r for r in runs if isinstance(r, str) and r):
            names += dispatch(conn, queue_stage, run)
    return names


def stop_extract_server(settings: Settings) -> list[str]:
    """Once extraction has drained, the run's vLLM extraction server Job goes, and its GPUs with it."""
    run = os.environ.get("EYRIE_JOB_RUN")
    if settings.gpu_scheduler != "kueue" or not settings.extract_vllm_url or not run:
        return []
    admission = KueueAdmission(settings)
    live = [j for j in admission.jobs("extract-server", run) if k8s_jobs.job_state(j) in ("waiting", "running")]
    for job in live:
        admission.client.delete_job(job["metadata"]["name"])
    return [job["metadata"]["name"] for job in live]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyrie.gpu_admission")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("drain", help="work a stage's queue until it is empty").add_argument("stage", choices=GPU_QUEUES)
    job = sub.add_parser("job", help="create (or find) a run's Job for a GPU stage")
    job.add_argument("stage")
    job.add_argument("--run", required=True)
    job.add_argument("--wait", action="store_true", help="wait until it succeeds or fails")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        conn = connect(settings.redis_url)
        if args.cmd == "drain":
            print(f"eyrie: {socket.gethostname()} drains the {args.stage} queue", flush=True)
            drain(conn, args.stage)
            if args.stage == "extract":
                for name in stop_extract_server(settings):
                    print(f"eyrie: extraction drained: stopped {name}", flush=True)
            for name in resume_waiting(conn):
                print(f"eyrie: tasks still wait: {name} queued for admission", flush=True)
            return 0
        admission = KueueAdmission(settings)
        name = admission.dispatch(conn, args.stage, args.run)
        if name is None:
            raise EyrieError(f"the chart renders no Job template for {args.stage!r}.", f"enable gpuJobs.{args.stage}.")
        print(name, flush=True)
        return 0 if not args.wait or admission.wait(name) == "succeeded" else 1
    except EyrieError as exc:
        print(f"eyrie: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
