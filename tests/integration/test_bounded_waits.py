"""Waits somebody can stop (issue 29, defect 5): a task waiting for the GPU lease gives up after
EYRIE_GPU_WAIT_S naming the holder, and ends at once on a cancel of its run or its worker's stop
request (SIGTERM); `eyrie run` stops waiting for a planning task a worker took and hangs in after
EYRIE_PLAN_WAIT_S, saying so. Real redis-server and store, the executor in this process; the GPU
lease is Redis's (no GPU is used: the task never gets past the wait)."""

import threading
import time

import pytest
import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.data.store import open_store
from eyrie.stages import EXTRACT, PLAN_GENERATE
from eyrie.tasks.executor import Context, ShardTask, StageTask, execute
from eyrie.tasks.gpu_admission import gpu_lease
from eyrie.work import cancel, keys
from eyrie.work.planning import await_planning
from eyrie.work.queue import _enqueue, queue

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
HOLDER = "vllm@elsewhere"


class GpuTask(StageTask):
    """A task that computes on cuda:0 under the GPU lease (extract's kind: only its task id is used)."""

    stage, Payload = EXTRACT, ShardTask

    def devices(self) -> str:
        return "cuda:0"

    def run(self) -> dict:
        return self.result("ran")


@pytest.fixture
def gpu_held(env):
    """Settings, Redis, the store, and cuda:0's lease held by another owner."""
    settings, conn = load_settings(), redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    holder = gpu_lease(settings, conn, HOLDER, "cuda:0")
    assert holder.acquire(wait_s=1)
    yield settings, conn, open_store(settings)
    holder.release()


def start(settings, conn, store, run: str) -> tuple[threading.Thread, dict]:
    """The task executed in a thread: its result or its error lands in the dict."""
    out: dict = {}

    def go():
        try:
            out["result"] = execute(GpuTask, {"run": run, "shard": 0}, Context(settings, conn, store))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


def waiting(conn) -> bool:
    return bool(conn.hlen(keys.GPU_WAITING))


def ends_within(thread: threading.Thread, seconds: float) -> float:
    began = time.monotonic()
    thread.join(seconds)
    assert not thread.is_alive(), f"the task still waited for the GPU lease {seconds:g} s later"
    return time.monotonic() - began


def test_a_task_waiting_for_the_gpu_lease_gives_up_after_its_bound_naming_the_holder(gpu_held):
    settings, conn, store = gpu_held
    thread, out = start(settings.model_copy(update={"gpu_wait_s": 1.0}), conn, store, "bound")
    ends_within(thread, 20)
    assert isinstance(out.get("error"), EyrieError), out
    message = str(out["error"])
    assert HOLDER in message and "EYRIE_GPU_WAIT_S" in message and "1 s" in message, message
    assert not waiting(conn)  # it no longer shows as a waiter


def test_a_cancel_ends_a_wait_for_the_gpu_lease(gpu_held):
    settings, conn, store = gpu_held
    thread, out = start(settings, conn, store, "cancelme")
    deadline = time.monotonic() + 20
    while not waiting(conn) and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.set(keys.cancelled("cancelme"), 1)
    ends_within(thread, 10)
    assert out.get("result", {}).get("status") == "cancelled", out


def test_a_stop_request_ends_a_wait_for_the_gpu_lease_and_hands_the_task_back(gpu_held):
    """What the worker's SIGTERM handler sets (eyrie.work.worker_loop: InProcessWorker, which runs
    GPU tasks in its own process)."""
    settings, conn, store = gpu_held
    thread, out = start(settings, conn, store, "stopme")
    deadline = time.monotonic() + 20
    while not waiting(conn) and time.monotonic() < deadline:
        time.sleep(0.05)
    cancel.STOP_REQUESTED.set()
    try:
        ends_within(thread, 10)
    finally:
        cancel.STOP_REQUESTED.clear()
    assert out.get("result", {}).get("status") == "handed_back", out


def test_eyrie_run_stops_waiting_for_a_planning_task_a_worker_took_and_hangs_in(env):
    conn, run = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), "hung"
    task = PLAN_GENERATE.task_id(run)
    _enqueue(conn, PLAN_GENERATE.queue, PLAN_GENERATE.func, {"run": run}, task, 60)
    queue(conn, PLAN_GENERATE.queue).remove(task)  # a worker took it off the queue...
    Job.fetch(task, connection=conn, serializer=JSONSerializer).set_status(JobStatus.STARTED)  # ...and hangs in it
    out: dict = {}

    def go():
        try:
            await_planning(conn, PLAN_GENERATE, run, wait_s=1.0)
        except EyrieError as exc:
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "`eyrie run` still waited for the planning task 20 s later"
    message = str(out.get("error"))
    assert "has not finished after 1 s" in message and "EYRIE_PLAN_WAIT_S" in message and run in message, message


def test_eyrie_verify_takes_the_gpu_lease_as_the_verify_task_does(gpu_held, env):
    """vLLM takes the GPUs: `eyrie verify` (what a skipped verify tells the user to run) waits for
    their lease like the verify task, bounded the same way, instead of starting beside its holder."""
    from tests.support.harness import TINY, TRAIN_PROMPTS, eyrie_in_process

    env = {**env, "EYRIE_MODEL": str(TINY), "EYRIE_INFERENCE_URL": "http://127.0.0.1:9", "EYRIE_GPU_WAIT_S": "1"}
    eyrie_in_process("generate", "--dataset", str(TRAIN_PROMPTS), "--limit", "4", "--run", "vr", env=env)
    result = eyrie_in_process("verify", "--run", "vr", env=env, check=False)
    assert result.returncode == 1, result.stdout
    assert "waiting for the GPU lease" in result.stdout and HOLDER in result.stderr, (result.stdout, result.stderr)
    assert "EYRIE_GPU_WAIT_S" in result.stderr, result.stderr
