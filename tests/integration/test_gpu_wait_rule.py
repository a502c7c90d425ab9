"""One rule for every wait for the GPUs (issue 41, item 6; eyrie.work.gpu_wait): a task's RQ job waits a
slice of it and hands the task back (neither a failed attempt nor one of its stop hand-backs), so its RQ
timeout never ends a wait for the GPUs; the wait lasts EYRIE_GPU_WAIT_S in all, then fails for good
naming the holder and what to do. The same for a task whose server waits for the GPUs (generate's
inference server, the vLLM extraction server of extract and of a training on demand).
Real Redis, store and `eyrie worker verify` processes; the GPU lease is Redis's (no GPU is used), and a
stand-in `vllm` that only leaves a mark (vLLM itself is not under test). Each wait is held at a known
point, the lease held by the test until it lets go: nothing depends on how fast the machine is."""

import hashlib
import subprocess
import threading
import time

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.data.manifest import Layout
from eyrie.data.store import open_store
from eyrie.stages import VERIFY
from eyrie.work import inference, keys
from eyrie.work.extract_server import ServerWait
from eyrie.work.gpu import GpuLease
from eyrie.work.queue import enqueue, job_state, workers_on
from tests.integration.test_verify_state import exported_run
from tests.support.harness import BIN, wait_for
from tests.support.processes import stop

pytestmark = pytest.mark.parametrize("store_env", ["file"], indirect=True)
HOLDER = "trainer@elsewhere"
HANDED_BACK = "handed back: waited"  # the worker's line for each hand-back of a wait (eyrie.tasks.executor)


@pytest.fixture
def held(env):
    """Every GPU of this host leased by another owner (a long training, say) until the test releases it."""
    conn = redis.Redis.from_url(env["EYRIE_REDIS_URL"])
    lease = GpuLease(conn, HOLDER, ttl_s=600)
    assert lease.acquire(wait_s=5)
    yield conn, lease
    lease.release()


def verify_worker(env, tmp_path, run: str, **settings) -> tuple[subprocess.Popen, object]:
    """A run ready to verify and a verify worker whose `vllm` only leaves a mark and exits."""
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    exported_run(conn, store, tmp_path, run)
    drafter = b"not a real drafter"
    store.put_bytes(f"runs/{run}/drafter/model.safetensors", drafter)
    store.put_json(Layout(run).drafter_manifest, {"files": {"model.safetensors": {
        "key": f"runs/{run}/drafter/model.safetensors", "sha256": hashlib.sha256(drafter).hexdigest()}}})
    vllm = tmp_path / "vllm"
    vllm.write_text(f"#!/bin/sh\ntouch {tmp_path / 'vllm-started'}\nsleep 1\nexit 3\n")
    vllm.chmod(0o755)
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([str(BIN / "eyrie"), "worker", "verify"], stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env={**env, "EYRIE_VLLM_COMMAND": str(vllm), **settings})
    wait_for(lambda: workers_on(conn, VERIFY.queue) or worker.poll() is not None, "the verify worker up", 120)
    assert worker.poll() is None, log.read_text()
    return worker, log


def states_until(conn, task: str, until, timeout: float) -> set[str]:
    """Every RQ state the task was seen in, polled until `until()` (at most `timeout` s)."""
    seen, deadline = set(), time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        seen.add(job_state(conn, task))
        time.sleep(0.05)
    assert until(), f"not within {timeout:g} s; states seen: {seen}"
    return seen


def last_error(conn, task: str) -> str:
    result = Job.fetch(task, connection=conn, serializer=JSONSerializer).latest_result()
    return (result.exc_string or "") if result else ""


def test_a_verify_waiting_longer_than_its_rq_timeout_for_the_gpus_is_neither_killed_nor_failed(held, env, tmp_path):
    """The lease held over three times the task's RQ timeout (4 s: a slice of 1 s): the task goes back
    to its queue meanwhile (no JobTimeoutException, no failure, no retry scheduled, no stop hand-back
    counted) and, once the lease is released, verifies (its stand-in vLLM is started)."""
    conn, lease = held
    worker, log = verify_worker(env, tmp_path, "vw")
    task = VERIFY.task_id("vw")
    try:
        enqueue(conn, VERIFY, {"run": "vw"}, timeout_s=4)
        began = time.monotonic()
        seen = states_until(conn, task, lambda: log.read_text().count(HANDED_BACK) >= 4
                            and time.monotonic() - began > 3 * 4, timeout=120)
        assert seen <= {"queued", "started"}, (seen, last_error(conn, task), log.read_text())
        job = Job.fetch(task, connection=conn, serializer=JSONSerializer)
        assert (job.number_of_retries or 0) <= 1 and job.retries_left == 3  # no attempt, no stop hand-back spent
        wait_for(lambda: conn.hlen(keys.GPU_WAITING), "its wait shown in status", 30)  # between two jobs: soon
        before = log.read_text()
        lease.release()
        wait_for(lambda: (tmp_path / "vllm-started").exists() or worker.poll() is not None, "vLLM started", 120)
        assert (tmp_path / "vllm-started").exists(), log.read_text()
    finally:
        stop(worker)
    assert "JobTimeoutException" not in before and "Traceback" not in before, before


def test_a_wait_for_the_gpus_ends_after_its_bound_in_all_naming_the_holder_and_for_good(held, env, tmp_path):
    """EYRIE_GPU_WAIT_S counts across the task's hand-backs; past it the task fails, RQ does not retry it
    (the same wait again), and its error names who holds the GPUs and what to do."""
    conn, _ = held
    worker, log = verify_worker(env, tmp_path, "vg", EYRIE_GPU_WAIT_S="6")
    task = VERIFY.task_id("vg")
    try:
        enqueue(conn, VERIFY, {"run": "vg"}, timeout_s=4)
        seen = states_until(conn, task, lambda: job_state(conn, task) == "failed", timeout=120)
    finally:
        stop(worker)
    assert "scheduled" not in seen, (seen, log.read_text())
    error = last_error(conn, task)
    assert HOLDER in error and "EYRIE_GPU_WAIT_S" in error and "eyrie retry vg" in error, error
    assert log.read_text().count(HANDED_BACK) >= 2, log.read_text()  # 6 s in slices of 1 s (and pick-ups)
    assert not (tmp_path / "vllm-started").exists()


def _publishing(publish, stop: threading.Event) -> threading.Thread:
    """A server that waits for the GPUs, republishing itself as it does (eyrie_inference.server)."""
    def go():
        while not stop.is_set():
            publish()
            stop.wait(0.5)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _ends(wait, seconds: float) -> dict:
    out: dict = {}

    def go():
        try:
            out["result"] = wait()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting {seconds:g} s later"
    return out


@pytest.mark.parametrize("server", ["extract", "inference"])
def test_a_task_whose_server_waits_for_the_gpus_waits_for_them_under_the_same_bound(server, held, env):
    """The vLLM extraction server (an extract task's, a training on demand's) and the inference server (a
    generate task's) waiting for the GPUs behind a long training: the task's wait is for the GPUs,
    EYRIE_GPU_WAIT_S (here 3 s) naming the holder, not EYRIE_SERVE_DEADLINE_S (0.5 s: extract gave up
    early) nor for ever (generate waited without bound). Outside an RQ job: the whole bound in one go."""
    conn, _ = held
    endpoint = inference.Endpoint(name=server, url="http://127.0.0.1:9", model="behind-a-training", server="vllm",
                                  state="waiting", progress=f"waiting for the GPUs ({HOLDER} holds them)")
    publish = (lambda: inference.publish_extract(conn, endpoint)) if server == "extract" else \
        (lambda: inference.publish(conn, endpoint))
    wait = (lambda: ServerWait(conn, 0.5, lambda text: None, lambda: False, 3).ready()) if server == "extract" else \
        (lambda: inference.wait_serving(conn, 0.5, lambda e: e.model == endpoint.model, endpoint.model, gpu_wait_s=3))
    stopped = threading.Event()
    _publishing(publish, stopped)
    try:
        began = time.monotonic()
        out = _ends(wait, 60)
    finally:
        stopped.set()
        conn.delete(keys.inference_endpoint(server), keys.EXTRACT_ENDPOINT)  # published endpoints outlive a test
    assert isinstance(out.get("error"), EyrieError), out
    message = str(out["error"])
    assert HOLDER in message and "EYRIE_GPU_WAIT_S" in message and "waited 3 s" in message, message
    assert time.monotonic() - began >= 3
