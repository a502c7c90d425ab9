"""The stack's inference service serves only a run that can still generate (issue 41, item 3): a run
whose generation failed for good, or that is blocked or cancelled, holds neither the server nor the
GPUs; one already served hands them back within Server.RELEASE_S. Real Redis and store;
tests/fake_vllm stands in for `vllm` (the supervision is under test, not vLLM)."""

import os
import subprocess

from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.stages.run_config import load_config
from eyrie.data.manifest import Layout, config_key
from eyrie.data.store import open_store
from eyrie.stages import GENERATE
from eyrie.work import inference, keys
from eyrie.work.gpu import holder
from eyrie.work.queue import enqueue
from eyrie_inference.server import Server, generating_run
from tests.support.builders import make_manifest
from tests.support.harness import BIN, OFFLINE, ROOT, own_db, tiny_run_config, wait_for
from tests.support.processes import free_port, stop


def _planned(conn, store, tmp_path, run: str, shards: int = 1) -> None:
    """What `eyrie run` and the run's planning leave: its config, active, `shards` generate shards planned."""
    store.put_json(config_key(run), load_config(tiny_run_config(tmp_path, run)).model_dump())
    store.put_json(Layout(run).manifest, make_manifest(run, shards, shard_size=1, max_retries=0).model_dump())
    conn.sadd(keys.ACTIVE_PIPELINES, run)


def _failed_for_good(conn, run: str, shard: int = 0) -> None:
    """The shard's generate task failed and its retries are spent (RQ's failed state)."""
    job = Job.create(GENERATE.func, id=GENERATE.task_id(run, shard), connection=conn, serializer=JSONSerializer)
    job.set_status(JobStatus.FAILED)
    job.save()


def test_a_run_that_cannot_generate_is_not_chosen_to_serve(redis_url, tmp_path):
    conn, _ = own_db(redis_url, 12)
    store = open_store(load_settings(store_url=f"file://{tmp_path / 'store'}"))
    _planned(conn, store, tmp_path, "a-failed")
    _planned(conn, store, tmp_path, "b-generating", shards=2)
    enqueue(conn, GENERATE, {"run": "a-failed", "shard": 0})
    enqueue(conn, GENERATE, {"run": "b-generating", "shard": 0}, 0)
    assert generating_run(conn, store) == "a-failed"  # first by name while it can generate
    _failed_for_good(conn, "a-failed")
    assert generating_run(conn, store) == "b-generating"
    _failed_for_good(conn, "b-generating", 1)  # one shard failed, another still to run: it generates on
    assert generating_run(conn, store) == "b-generating"
    for mark in (keys.blocked("b-generating"), keys.cancelled("b-generating")):
        conn.set(mark, "now")
        assert generating_run(conn, store) is None, mark
        conn.delete(mark)
    enqueue(conn, GENERATE, {"run": "a-failed", "shard": 0})  # `eyrie retry` requeues it
    assert generating_run(conn, store) == "a-failed"


def test_the_service_hands_the_gpus_back_once_its_runs_generation_failed(redis_url, tmp_path):
    """Served and ready, its run's only generate task fails for good: vLLM stops and the GPU lease is
    free within RELEASE_S (the README's figure), and the service waits for the next run."""
    conn, url = own_db(redis_url, 13)
    store_url = f"file://{tmp_path / 'store'}"
    store = open_store(load_settings(store_url=store_url))
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": store_url,
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    _planned(conn, store, tmp_path, "fails")
    enqueue(conn, GENERATE, {"run": "fails", "shard": 0})
    log = tmp_path / "serve.log"
    server = subprocess.Popen([str(BIN / "eyrie"), "serve", "--server", "vllm", "--run", "active",
                               "--port", str(free_port())], env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (e := inference.read(conn)) is not None and e.state == "ready", "run fails served", 60)
        assert holder(conn) is not None
        _failed_for_good(conn, "fails")
        wait_for(lambda: inference.read(conn).state == "stopped" and holder(conn) is None,
                 "the GPUs handed back", timeout=Server.RELEASE_S)
        waiting = lambda: "waiting for a pipeline to generate" in log.read_text().split("can no longer generate")[-1]  # noqa: E731
        wait_for(waiting, "the service waiting for the next pipeline", timeout=30)  # printed after it stopped
        text = log.read_text()
        assert "run fails can no longer generate" in text and server.poll() is None, text
    finally:
        stop(server)
