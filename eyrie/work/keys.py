"""Every Redis key eyrie writes, in one place: the counterpart of the store's `Layout`
(eyrie/data/manifest.py). RQ's own keys (rq:*) are RQ's; a queue's name is `eyrie.work.task_kinds.queue_name`
of a queue a stage declares (eyrie.stages). Redis holds live state only; the store is the record.

Keys of one thing are built by calling its name: `keys.task_lease(task_id)`, `keys.cancelled(run)`."""

from __future__ import annotations

# runs and pipelines
RUNS = "eyrie:runs"  # every run whose manifest was written (the store's runs/ may be huge on S3)
ACTIVE_PIPELINES = "eyrie:pipelines:active"  # runs started by `eyrie run` and not yet exported
cancelled = "eyrie:pipeline:{}:cancelled".format  # (run) set by `eyrie cancel`: nothing more of it starts
blocked = "eyrie:pipeline:{}:blocked".format  # (run) a refusal the user must fix (storage budget, a base drafter)
restarting = "eyrie:pipeline:{}:restarting".format  # (run) a list: the planning tasks a start of the cancelled run waits for
advance_lock = "eyrie:advance:{}".format  # (run) one `advance` of a run at a time
worker_left = "eyrie:worker-left:{}".format  # (queue) when a worker of the queue last stopped (unix time)

# tasks
task_lease = "eyrie:lease:{}".format  # (task id) who works on the task now (eyrie.work.queue.task_lease)
job_alive = "eyrie:alive:{}".format  # (job id) kept fresh by the worker running the job, callbacks too
generate_claims = "eyrie:generate:claims:{}".format  # (task id) the shards a chained generate task took on
admit_lock = "eyrie:admit:{}:{}".format  # (GPU Job stage, run) one creator at a time of a run's Kubernetes Job

# live progress
progress = "eyrie:progress:{}:{}".format  # (run, stage) a hash: task -> its live progress (JSON)
stage_started = "eyrie:stage:{}:{}".format  # (run, stage) a hash: when its first progress came (started_at)
rates = "eyrie:rates:{}:{}".format  # (run, stage) a hash: "task:width:interval" -> [time, tokens, started] (JSON)
curve = "eyrie:curve:{}:{}".format  # (run, stage) the training curve so far (JSON), as its store copy will hold it

VERIFY_RATES = "eyrie:verify:rates"  # a hash: target -> the slowest tok/s its verify measured at 8 and at 1 in flight

# the GPUs: a lease per device set (eyrie.work.gpu), one key per (host, device) it holds
GPU_LEASE = "eyrie:gpu:lease"  # a hash: lease token -> its holder (JSON), for status; there while any lease is held
gpu_device = "eyrie:gpu:device:{}:{}".format  # (host, device id; * = the whole host) the holding lease's token, with a TTL
gpu_host_devices = "eyrie:gpu:devices:{}".format  # (host) a set: the device ids ever leased there (what `*` checks)
GPU_WAITING = "eyrie:gpu:waiting"  # a hash: waiting lease's token -> who waits, for which devices, since when (JSON)

# free space where the bytes go (eyrie.work.disk): reported by the workers that store them, read by --plan
disk_report = "eyrie:disk:{}:{}".format  # (stage, host) {dir, free, total, host, at} (JSON), with a TTL

# where the target is served
INFERENCE_PREFIX = "eyrie:inference:"
EXTRACT_ENDPOINT = "eyrie:extract:endpoint"  # the vLLM extraction server: never one of the inference endpoints


def inference_endpoint(name: str) -> str:
    return f"{INFERENCE_PREFIX}{name}"


def endpoint_name(key: str) -> str:
    """The endpoint's name in an inference_endpoint key."""
    return key.removeprefix(INFERENCE_PREFIX)
