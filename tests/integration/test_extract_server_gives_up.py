"""The stack's vLLM extraction server serves only a run that can still use it (issue 41, item 3): a run
whose extraction (or, training on demand, whose training) failed for good, or that is blocked or
cancelled, holds neither the server nor the GPUs: one already served hands them back within
Server.RELEASE_S, one still waiting for them stops waiting. The same predicate as the inference
server's (eyrie.runs.pipeline.can_go_on). Real Redis and store; tests/fake_vllm stands in for `vllm`
(the supervision is under test, not vLLM)."""

import os
import subprocess

from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.data.store import open_store
from eyrie.stages import EXTRACT, TRAIN
from eyrie.work import inference, keys
from eyrie.work.gpu import GpuLease, holder, leases
from eyrie.work.queue import enqueue
from eyrie_inference.extract_server import ExtractServer, extraction_run
from eyrie_inference.server import Server
from tests.e2e.test_extract_server import RUN, extract_server_ready
from tests.e2e.test_extract_server_lifetime import _plant, _settings
from tests.support.builders import make_manifest
from tests.support.harness import BIN, ROOT, own_db, wait_for
from tests.support.processes import free_port, stop


def _failed_for_good(conn, kind, run: str, shard: int = 0) -> None:
    """The task failed and its retries are spent (RQ's failed state)."""
    job = Job.create(kind.func, id=kind.task_id(run, shard), connection=conn, serializer=JSONSerializer)
    job.set_status(JobStatus.FAILED)
    job.save()


def _serve_extract(url: str, tmp_path) -> tuple[subprocess.Popen, object]:
    """`eyrie serve-extract --once` on its own Redis database and the test's store."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "EYRIE_EXTRACT_SHARED_DIR": str(tmp_path / "hs"),
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    log = tmp_path / "serve-extract.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve-extract", "--once", "--port", str(free_port())], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def test_a_run_that_cannot_use_the_extraction_server_is_not_chosen_and_a_served_one_lets_it_go(redis_url, tmp_path):
    conn, url = own_db(redis_url, 13)
    store = open_store(_settings(url, tmp_path))
    _plant(conn, store, "a-offline", "offline", shards=(0,))  # shard 1 still to extract
    _plant(conn, store, RUN, "hybrid", shards=(0,))
    enqueue(conn, EXTRACT, {"run": "a-offline", "shard": 1}, 1)
    assert extraction_run(conn, store) == "a-offline"
    _failed_for_good(conn, EXTRACT, "a-offline", 1)
    assert extraction_run(conn, store) == RUN  # its extract shard 1 not enqueued yet: it can go on
    for mark in (keys.blocked(RUN), keys.cancelled(RUN)):
        conn.set(mark, "now")
        assert extraction_run(conn, store) is None, mark
        conn.delete(mark)
    enqueue(conn, EXTRACT, {"run": "a-offline", "shard": 1}, 1)  # `eyrie retry` requeues it
    assert extraction_run(conn, store) == "a-offline"

    store.put_json(Layout(RUN).extract_shard_manifest(1), {})  # extracted: its training reads the server now
    manifest = load_run_manifest(store, RUN)
    manifest.train = make_manifest(RUN, train={}).train  # planned
    store.put_json(Layout(RUN).manifest, manifest.model_dump())
    server = ExtractServer(_settings(url, tmp_path), conn, store, RUN)
    assert not server._drained()
    _failed_for_good(conn, TRAIN, RUN)
    assert server._drained()
    assert extraction_run(conn, store) == "a-offline"  # the one that can


def test_serve_extract_hands_the_gpus_back_once_its_runs_extraction_failed(redis_url, tmp_path):
    """Served and ready, its run's last extract shard fails for good: vLLM stops and the GPU lease is
    free within RELEASE_S (the README's figure)."""
    conn, url = own_db(redis_url, 14)
    store = open_store(_settings(url, tmp_path))
    _plant(conn, store, RUN, "offline", shards=(0,))
    enqueue(conn, EXTRACT, {"run": RUN, "shard": 1}, 1)
    proc, log = _serve_extract(url, tmp_path)
    try:
        extract_server_ready(conn, 60)
        assert holder(conn)["holder"]["owner"].startswith("extract-server@")
        _failed_for_good(conn, EXTRACT, RUN, 1)
        wait_for(lambda: inference.read_extract(conn).state == "stopped" and holder(conn) is None,
                 "the GPUs handed back", timeout=Server.RELEASE_S)
        assert proc.wait(30) == 0, log.read_text()
        assert f"run {RUN} can no longer use it (its extract failed for good" in log.read_text()
    finally:
        stop(proc)


def test_serve_extract_waiting_for_the_gpus_stops_waiting_once_its_run_is_cancelled(redis_url, tmp_path):
    """The GPUs held by another owner (a long training): the server waits for them, published as
    `waiting`; its run cancelled, it stops waiting within Server.POLL_S (and a poll of the lease), never
    starting vLLM, and leaves the GPUs to whoever comes next."""
    conn, url = own_db(redis_url, 15)
    store = open_store(_settings(url, tmp_path))
    _plant(conn, store, RUN, "offline", shards=(0,))
    enqueue(conn, EXTRACT, {"run": RUN, "shard": 1}, 1)
    training = GpuLease(conn, "trainer@elsewhere", ttl_s=600)
    assert training.acquire(wait_s=5)
    proc, log = _serve_extract(url, tmp_path)
    try:
        wait_for(lambda: (e := inference.read_extract(conn)) is not None and e.state == "waiting"
                 or proc.poll() is not None, "the server waiting for the GPUs", 60)
        assert "trainer@elsewhere" in inference.read_extract(conn).progress, log.read_text()
        conn.set(keys.cancelled(RUN), "now")
        assert proc.wait(Server.POLL_S + 25) == 0, log.read_text()
        text = log.read_text()
        assert "no longer waiting for the GPUs" in text and "extract_hidden_states" not in text, text
        assert inference.read_extract(conn).state == "stopped"
        found = leases(conn)
        assert [h["owner"] for h in found["holders"]] == ["trainer@elsewhere"] and not found["waiting"], found
    finally:
        stop(proc)
        training.release()
