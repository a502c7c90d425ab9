"""Defects of the Compose stack found by review (issue 12), each checked on the real parts: a GPU
stage frees the device memory before it gives the GPU lease back; the task and GPU leases live
through a wait for the GPU and a slow load; `eyrie serve` fails when vLLM dies after it was ready;
a blocked or cancelled run does not keep the inference server down."""

import json
import os
import signal
import subprocess
import threading
import time
import weakref

import psutil
import pytest
import redis

from eyrie.work import inference, keys
from eyrie.work.gpu import GpuLease, holder
from eyrie.work.queue import LEASE_TTL_S, Heartbeat, held_task
from tests.support.builders import make_manifest
from tests.support.harness import BIN, OFFLINE, ROOT, TINY, TRAIN_PROMPTS, eyrie, eyrie_in_process, own_db, wait_for
from tests.support.processes import free_port, stop


def test_the_extractor_drops_the_target_before_the_gpu_lease_goes(redis_url):
    """The lease says who computes; the memory must follow it: when the lease is free, nothing
    of ours still holds the model (the next vLLM start checks free device memory)."""
    from eyrie.core.config import load_settings
    from eyrie_extractor.shard import extractor_gpu_lease, loaded_capture

    conn, _ = own_db(redis_url, 7)
    lease = extractor_gpu_lease(load_settings(), conn, "cpu")
    assert lease.acquire(wait_s=5)
    model = weakref.ref(loaded_capture(str(TINY), (2, 4, 5), "cpu").model)
    assert model() is not None and loaded_capture.cache_info().currsize == 1
    seen_when_free = []

    def watch():  # what a waiting stage would find the moment the lease is free
        while conn.exists(keys.GPU_LEASE):
            time.sleep(0.001)
        seen_when_free.append(model())

    watcher = threading.Thread(target=watch)
    watcher.start()
    lease.release()
    watcher.join(10)
    assert seen_when_free == [None], "the model was still alive when the GPU lease was free"
    assert loaded_capture.cache_info().currsize == 0 and holder(conn) is None


def test_leases_live_through_a_gpu_wait_and_a_load_longer_than_their_ttl(redis_url):
    """A task that waits for the GPU (another stage holds it past LEASE_TTL_S) and then loads
    slowly keeps its task lease and its GPU lease: no second worker takes the task over."""
    conn, _ = own_db(redis_url, 8)
    other = GpuLease(conn, "inference@elsewhere", ttl_s=3)
    assert other.acquire(wait_s=5)

    def hold_then_release():  # the inference service, renewing its lease past LEASE_TTL_S
        for _ in range(LEASE_TTL_S + 3):
            other.renew()
            time.sleep(1)
        other.release()

    threading.Thread(target=hold_then_release, daemon=True).start()
    with held_task(conn, "extract-slow-00000") as lease:
        gpu = GpuLease(conn, "extractor@here", ttl_s=3)
        with Heartbeat(lease, gpu, every_s=1) as beat:
            started = time.monotonic()
            assert gpu.acquire(wait_s=LEASE_TTL_S + 30, poll_s=0.2)
            assert time.monotonic() - started > LEASE_TTL_S  # waited past the task lease's TTL
            time.sleep(6)  # a slow model load: twice the GPU lease's TTL
            assert lease.owned() and conn.exists(keys.task_lease("extract-slow-00000"))
            assert holder(conn)["holder"]["owner"] == "extractor@here" and not beat.lost
            with held_task(conn, "extract-slow-00000") as second:  # another worker, meanwhile
                assert second is None
            gpu.release()


def test_serve_fails_when_vllm_dies_after_it_was_ready(redis_url, tmp_path):
    """Exit non-zero (so that `restart: on-failure` starts it again) and publish `failed`."""
    conn, _ = own_db(redis_url, 9)
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/9",
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}",
           "EYRIE_SERVER": "vllm", "EYRIE_PORT": str(free_port()), "EYRIE_MODEL": str(TINY)}
    log = tmp_path / "serve.log"
    server = subprocess.Popen([str(BIN / "eyrie"), "serve"], env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (e := inference.read(conn)) and e.state == "ready", "the server ready", timeout=60)
        (vllm,) = psutil.Process(server.pid).children()
        vllm.send_signal(signal.SIGKILL)  # vLLM crashes (an OOM kill, a dead engine core)
        assert server.wait(60) == 1, log.read_text()
        assert "after it was ready" in log.read_text() and inference.read(conn).state == "failed"
        assert holder(conn) is None  # the GPU lease went with it
    finally:
        stop(server)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_blocked_or_cancelled_run_does_not_keep_the_server_down(env, stub_server, workers):
    """A generated run whose later stages wait would stop the inference server ("drained"): a
    blocked or cancelled run waits for a person, not for the GPUs."""
    from eyrie.core.config import load_settings
    from eyrie.data.manifest import config_key
    from eyrie.data.store import open_store
    from eyrie.runs.pipeline import drained_run
    from eyrie.stages import task_id
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    env = workers.env = {**env, "EYRIE_INFERENCE_URL": stub_server()}
    eyrie("generate", "--dataset", str(TRAIN_PROMPTS), "--run", "stalled", "--limit", "8", "--max-tokens", "8",
          env=env)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(load_settings())
    kept = store.get_json(config_key("stalled"))
    del kept["stages"]  # a run of generate alone made a whole pipeline: its later stages wait (no worker of theirs)
    store.put_json(config_key("stalled"), kept)
    workers.start("generate")
    assert wait_for(lambda: drained_run(conn, store), "generation drained", timeout=120) == "stalled"
    conn.set(keys.blocked("stalled"), "over its storage budget")
    assert drained_run(conn, store) is None
    conn.delete(keys.blocked("stalled"))
    conn.set(keys.cancelled("stalled"), "now")
    assert drained_run(conn, store) is None
    conn.delete(keys.cancelled("stalled"))
    assert drained_run(conn, store) == "stalled"
    failed = Job.create("eyrie_trainer.plan.run_train_task", id=task_id("train", "stalled", 0), connection=conn,
                        serializer=JSONSerializer)  # its train task failed for good (retries spent)
    failed.set_status(JobStatus.FAILED)
    failed.save()
    assert drained_run(conn, store) is None


def test_the_projection_counts_the_trainers_local_copy():
    """The seed's run: the trainer copies every hidden-state file to its own disk (the stack's
    EYRIE_TRAINER_CACHE_DIR): as many bytes as the extract stage stores, said by `--plan`."""
    seed = str(ROOT / "examples" / "run.kimi-k2.5.yaml")
    env = {**os.environ, **OFFLINE}
    out = eyrie_in_process("run", "--config", seed, "--plan", env=env).stdout
    plan = json.loads(eyrie_in_process("run", "--config", seed, "--plan", "--json", env=env).stdout)
    stored = plan["storage"]["modes"][plan["storage"]["chosen"]]["trainer_cache_bytes"]  # hybrid: part of them
    assert plan["space"]["trainer_copy_bytes"] == stored > 0
    assert "the trainer's local copy" in out and "EYRIE_TRAINER_CACHE_DIR" in out, out


def _run_manifest(run: str) -> dict:
    """A planned run of one generate shard (what drained_run and generating_run read)."""
    return make_manifest(run, 1, max_retries=0).model_dump()


def test_the_stacks_inference_serves_run_after_run(redis_url, tmp_path):
    """`eyrie serve --run active` (the Compose inference service) stays up between runs: the first
    run's server stops once its generation drains and hands the GPUs over; a second run started
    while the first one's later stages hold them (a trainer's lease here) is served once they are
    given back, its server saying meanwhile that it waits for them. tests/fake_vllm stands in for
    `vllm` (the supervision is under test, not vLLM)."""
    from eyrie.core.config import load_settings
    from eyrie.stages.run_config import load_config
    from eyrie.data.manifest import Layout, config_key
    from eyrie.data.store import open_store
    from eyrie.stages import PIPELINE
    from eyrie.tasks.gpu_admission import gpu_lease
    from eyrie.work.queue import enqueue

    from tests.support.harness import tiny_run_config

    conn, _ = own_db(redis_url, 10)
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/10",
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    settings = load_settings(store_url=env["EYRIE_STORE_URL"], redis_url=env["EYRIE_REDIS_URL"])
    store = open_store(settings)

    def start(run: str) -> None:  # what `eyrie run` leaves for the inference service to see
        store.put_json(config_key(run), load_config(tiny_run_config(tmp_path, run)).model_dump())
        conn.sadd(keys.ACTIVE_PIPELINES, run)

    def state(wanted: str):
        return lambda: (e := inference.read(conn)) is not None and e.state == wanted

    log = tmp_path / "serve.log"
    server = subprocess.Popen([str(BIN / "eyrie"), "serve", "--server", "vllm", "--run", "active",
                               "--port", str(free_port())], env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start("one")
        wait_for(state("ready"), "run one served", timeout=60)
        store.put_json(Layout("one").manifest, _run_manifest("one"))
        store.put_json(Layout("one").generate_shard_manifest(0), {})  # generated: extract and train wait
        wait_for(lambda: state("stopped")() and holder(conn) is None, "the GPUs handed over", timeout=60)
        assert server.poll() is None, log.read_text()

        trainer = gpu_lease(settings, conn, "trainer@test")  # run one trains
        assert trainer.acquire(wait_s=5)
        start("two")
        enqueue(conn, PIPELINE[0].planner, {"run": "two"})  # its planning, queued (no worker here)
        wait_for(state("waiting"), "run two's server waiting for the GPUs", timeout=60)
        assert "trainer@test" in inference.read(conn).progress
        trainer.release()
        wait_for(state("ready"), "run two served", timeout=60)
        assert "serving run two's target" in log.read_text() and server.poll() is None
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()
        assert state("stopped")() and holder(conn) is None
    finally:
        stop(server)


def test_generate_waits_for_a_server_that_waits_for_the_gpus(redis_url):
    """A run started while another trains: its server is published `waiting` (for the GPUs) and
    republished while it lives; its generate tasks wait for it past EYRIE_SERVE_DEADLINE_S, and
    not for a `waiting` server that stopped republishing (gone)."""
    from eyrie.core.errors import EyrieError
    from eyrie.core.target import describe, same_target

    conn, _ = own_db(redis_url, 11)
    target = describe(str(TINY))
    endpoint = inference.Endpoint(url="http://127.0.0.1:9", model=target.model, server="vllm", state="waiting",
                                  revision=target.revision, chat_template_sha256=target.chat_template_sha256)
    done = threading.Event()

    def the_server():  # waits for the GPUs for 3 s (twice the deadline), then is ready
        started = time.monotonic()
        while not done.is_set():
            endpoint.state = "waiting" if time.monotonic() - started < 3 else "ready"
            inference.publish(conn, endpoint)
            done.wait(0.5)

    threading.Thread(target=the_server, daemon=True).start()
    try:
        (served,) = inference.wait_serving(conn, 1.5, lambda e: same_target(target, e), target.model, gpu_wait_s=3600)
        assert served.state == "ready"
    finally:
        done.set()
    endpoint.state, endpoint.updated_at = "waiting", time.time() - inference.WAITING_FRESH_S - 1
    conn.set(keys.inference_endpoint("default"), endpoint.model_dump_json())  # its last word, long ago
    with pytest.raises(EyrieError, match="waiting"):
        inference.wait_serving(conn, 1.5, lambda e: same_target(target, e), target.model, gpu_wait_s=3600)
