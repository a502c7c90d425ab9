"""Every Redis key eyrie writes, in one place: the counterpart of the store's `Layout`
(eyrie/manifest.py). RQ's own keys (rq:*) are RQ's; the queues' names come from eyrie/stages.py.
Redis holds live state only; the store is the record.

Keys of one thing are built by calling its name: `keys.task_lease(task_id)`, `keys.cancelled(run)`."""

from __future__ import annotations

# runs and pipelines
RUNS = "eyrie:runs"  # every run whose manifest was written (the store's runs/ may be huge on S3)
ACTIVE_PIPELINES = "eyrie:pipelines:active"  # runs started by `eyrie run` and not yet exported
cancelled = "eyrie:pipeline:{}:cancelled".format  # (run) set by `eyrie cancel`: nothing more of it starts
blocked = "eyrie:pipeline:{}:blocked".format  # (run) a refusal the user must fix (storage budget, a base drafter)
advance_lock = "eyrie:advance:{}".format  # (run) one `advance` of a run at a time

# tasks
task_lease = "eyrie:lease:{}".format  # (task id) who works on the task now (eyrie.queue.task_lease)
job_alive = "eyrie:alive:{}".format  # (job id) kept fresh by the worker running the job, callbacks too
generate_claims = "eyrie:generate:claims:{}".format  # (task id) the shards a chained generate task took on
admit_lock = "eyrie:admit:{}:{}".format  # (GPU Job stage, run) one creator at a time of a run's Kubernetes Job

# live progress
progress = "eyrie:progress:{}:{}".format  # (run, stage) a hash: task -> its live progress (JSON)
stage_started = "eyrie:stage:{}:{}".format  # (run, stage) a hash: when its first progress came (started_at)

# the GPUs
GPU_LEASE = "eyrie:gpu:lease"
GPU_HOLDER = "eyrie:gpu:holder"  # who holds the lease (JSON), for status
GPU_WAITING = "eyrie:gpu:waiting"  # a hash: owner -> since when it waits

# where the target is served
INFERENCE_PREFIX = "eyrie:inference:"
EXTRACT_ENDPOINT = "eyrie:extract:endpoint"  # the vLLM extraction server: never one of the inference endpoints


def inference_endpoint(name: str) -> str:
    return f"{INFERENCE_PREFIX}{name}"


def endpoint_name(key: str) -> str:
    """The endpoint's name in an inference_endpoint key."""
    return key.removeprefix(INFERENCE_PREFIX)
