"""Who may use the GPUs now, behind one interface: the Redis leases per device set (Compose, and
hosts sharing one Redis), or Kueue's admission of a Job per GPU stage on Kubernetes.
EYRIE_GPU_SCHEDULER picks one.

Stages ask `gpu_lease(settings, conn, owner, devices)` for a lease (acquire, renew, release):
- redis: eyrie.work.gpu.GpuLease: a lease per (host, GPU) in Redis sequences serve, extract and train
  on the same GPUs; disjoint GPUs, or other hosts, run side by side (EYRIE_GPU_HOST, EYRIE_GPU_IDS).
- kueue: the pod runs only once Kueue has admitted its Job within the ClusterQueue's quota, so
  the GPUs it requested are its own: the lease is granted at once.

Enqueueing a GPU stage's tasks calls `eyrie.work.kueue.dispatch`: nothing under redis (the stage's
workers run all the time and wait for the lease); under kueue it creates the stage's Job for the
run (once while one is pending or running), whose container drains the stage's queue (`drain`
here) and exits, freeing the quota for the next stage or the next run.

    python -m eyrie.tasks.gpu_admission drain extract      # the command of a GPU Job's container
    python -m eyrie.tasks.gpu_admission job train --run r1 --wait
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from eyrie.core.config import Settings, load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages import gpu_queues, queues
from eyrie.work import gpu, k8s_jobs
from eyrie.work.cancel import stop_requested
from eyrie.work.gpu_wait import GpuWait
from eyrie.work.kueue import KueueAdmission, dispatch, servers_done
from eyrie.work.queue import connect, queue
from eyrie.work.task_kinds import jobs_for_queue
from eyrie.work.worker_loop import run_worker

SCHEDULERS = ("redis", "kueue")


class Admitted:
    """The lease of a pod Kueue admitted: its GPUs are its own for as long as it runs."""

    def __init__(self, owner: str, devices: str = "all", caches: tuple = ()):
        self.owner, self.devices, self.caches = owner, devices, caches

    def acquire(self, wait_s: float | None = None, poll_s: float = 1.0, stop=None, since=None) -> bool:
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


def acquire_within(lease, bound_s: float, stop=None) -> None:
    """The lease, under the one rule for every wait for the GPUs (eyrie.work.gpu_wait): at most
    `bound_s` (EYRIE_GPU_WAIT_S) in all, then an error naming who holds the GPUs and what to do;
    inside an RQ job, a slice of it at a time, then the task goes back to its queue to wait on
    (WaitingForGpus). `stop()` ends the wait early by raising (the run cancelled, the worker stopping)."""
    wait = GpuWait(bound_s, lambda: f"the GPU lease of {','.join(lease.device_ids)} on {lease.host} ({lease.owner})")
    if not lease.acquire(wait_s=0, stop=stop):
        while True:
            wait.check(lease.conn)
            if lease.acquire(wait_s=wait.left_s(), stop=stop, since=wait.since):
                break
    wait.over()  # had: a later wait of the task (for a server, say) counts afresh


@contextmanager
def held_gpu(settings: Settings, conn, owner: str, devices: str = "all", say=print) -> Iterator[None]:
    """The GPU lease around a command's own GPU work (`eyrie verify`), as a task holds it: waited
    for within EYRIE_GPU_WAIT_S (a waiter in status meanwhile), renewed while the block runs,
    released after it."""
    lease = gpu_lease(settings, conn, f"{owner}@{socket.gethostname()}", devices)
    if not lease.acquire(wait_s=0):
        say(f"waiting for the GPU lease (held by {gpu.holders_text(conn)}), at most {settings.gpu_wait_s:g} s")
        acquire_within(lease, settings.gpu_wait_s)
    done = threading.Event()

    def renew() -> None:
        while not done.wait(gpu.TTL_S / 3):
            try:
                lease.renew()
            except redis.exceptions.ConnectionError:
                continue  # Redis away for a moment: the lease lasts TTL_S

    threading.Thread(target=renew, daemon=True, name="eyrie-gpu-lease").start()
    try:
        yield
    finally:
        done.set()
        lease.release()


def drain(conn, stage: str, poll_s: float = 5.0) -> None:
    """Work a stage's queue until nothing is queued or waiting for a retry, then return: the Job
    completes and Kueue hands its quota on."""
    q = queue(conn, stage)
    while True:
        run_worker(conn, stage, burst=True)
        if stop_requested() or q.count + q.scheduled_job_registry.count + q.deferred_job_registry.count == 0:
            return
        time.sleep(poll_s)


def resume_waiting(conn) -> list[str]:
    """Once a GPU Job's work is done: the Jobs of every run whose tasks still wait in a queue (a
    server admitted while another run's later stages waited hands its GPUs back at once, and is
    created again here)."""
    names = []
    for queue_stage in [q for q in queues() if jobs_for_queue(q)]:
        runs = {job.args[0].get("run") for job in queue(conn, queue_stage).get_jobs() if job and job.args}
        for run in sorted(r for r in runs if isinstance(r, str) and r):
            names += dispatch(conn, queue_stage, run)
    return names


def stop_servers(settings: Settings, queue_name: str) -> list[str]:
    """Once a queue has drained, the run's server Jobs no task needs any more go, and their GPUs
    with them (the vLLM extraction server: after extraction, or after training where the run trains
    on demand; eyrie.work.kueue.servers_done)."""
    run = settings.job_run
    if settings.gpu_scheduler != "kueue" or not run:
        return []
    admission = KueueAdmission(settings)
    live = [j for server in servers_done(settings, queue_name, run) for j in admission.jobs(server, run)
            if k8s_jobs.job_state(j) in ("waiting", "running")]
    for job in live:
        admission.client.delete_job(job["metadata"]["name"])
    return [job["metadata"]["name"] for job in live]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyrie.tasks.gpu_admission")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("drain", help="work a stage's queue until it is empty").add_argument("stage", choices=gpu_queues())
    job = sub.add_parser("job", help="create (or find) a run's Job for a GPU stage")
    job.add_argument("stage")
    job.add_argument("--run", required=True)
    job.add_argument("--wait", action="store_true", help="wait until it succeeds or fails")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        conn = connect(settings.redis_url, wait_s=settings.redis_wait_s if args.cmd == "drain" else 0)
        if args.cmd == "drain":
            print(f"eyrie: {socket.gethostname()} drains the {args.stage} queue", flush=True)
            drain(conn, args.stage)
            for name in stop_servers(settings, args.stage):
                print(f"eyrie: {args.stage} drained: stopped {name}", flush=True)
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
