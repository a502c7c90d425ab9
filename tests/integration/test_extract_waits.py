"""An extract task of the vLLM backend waits for the stack's extraction server (`eyrie serve-extract`)
(issue 21, item 11): its status says what it waits for (the server's state, when it was last seen,
the bound), it gives up after EYRIE_SERVE_DEADLINE_S naming the problem and the fix, a server that
was ready and died is named dead (not a blind "Connection error"), and a cancel of the run or a
SIGTERM to the worker ends the wait. Real redis-server, real `eyrie worker extract` processes; no
vLLM: the situations without one (nothing published, a stale or failed endpoint, a port that
refuses connections) are published directly through eyrie.work.inference.publish_extract."""

import json
import signal
import socket
import threading
import time

import orjson
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from eyrie.core.errors import EyrieError
from eyrie.work import inference, keys
from eyrie.work.cancel import Cancelled
from eyrie.work.extract_server import ServerWait, health
from tests.support.builders import publish_endpoint
from tests.support.harness import TINY, eyrie, wait_for
from tests.support.processes import free_port

RUN, TASK = "xw", "extract-xw-00000"
FILE_STORE = pytest.mark.parametrize("store_env", ["file"], indirect=True)  # one store is enough


@pytest.fixture
def planned(env, stub_server, tmp_path):
    """A generated run whose extract stage is planned on the vLLM backend, its one task queued."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(4)))
    genv = {**env, "EYRIE_INFERENCE_URL": stub_server(tokens=8), "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    eyrie("generate", "--dataset", str(data), "--run", RUN, "--max-tokens", "8", env=genv)
    eyrie("worker", "generate", "--burst", env=genv)
    assert "1 tasks enqueued now" in eyrie("extract", "--run", RUN, "--backend", "vllm", "--layers", "2,4,5",
                                           env=env).stdout
    return redis.Redis.from_url(env["EYRIE_REDIS_URL"])


def _publish(conn, url: str, state: str = "ready", age_s: float = 0.0) -> None:
    endpoint = publish_endpoint(conn, str(TINY), url, name="extract", state=state, extract=True)
    if age_s:  # last published `age_s` ago: its `eyrie serve-extract` stopped republishing it
        endpoint.updated_at -= age_s
        conn.set(keys.EXTRACT_ENDPOINT, orjson.dumps(endpoint.model_dump()))


def _extract(env) -> dict:
    return json.loads(eyrie("status", RUN, "--json", env=env).stdout)["stages"]["extract"]


def _waiting_for(env, *words: str) -> str:
    def seen():
        stage = _extract(env)
        return next((w for w in stage["waiting_for"] if all(word in w for word in words)), None)
    return wait_for(seen, f"the extract stage waiting for {words}", timeout=90, every=0.5)


def _waiting(env) -> list[str]:
    return wait_for(lambda: _extract(env)["waiting_for"], "the extract task waiting", timeout=90, every=0.5)


def _job(conn) -> Job:
    return Job.fetch(TASK, connection=conn, serializer=JSONSerializer)


def _start_extract_worker(workers, env, deadline_s: float):
    workers.env = {**env, "EYRIE_SERVE_DEADLINE_S": str(deadline_s)}
    workers.start("extract")
    return workers.procs["extract"][-1]


@FILE_STORE
def test_with_no_server_the_task_says_so_and_gives_up_after_the_stated_bound(env, planned, workers):
    worker = _start_extract_worker(workers, env, 15)
    shown = _waiting_for(env, "the vLLM extraction server (state: never published)", "at most 15 s",
                         "EYRIE_SERVE_DEADLINE_S")
    assert _extract(env)["state"] == "in_progress", shown
    # past the bound the attempt fails, naming the problem and the fix; RQ retries it later
    wait_for(lambda: _job(planned).get_status() == "scheduled", "the attempt failed and scheduled again", 60)
    log = workers.log_text("extract")
    assert "no vLLM extraction server became ready within 15 s (EYRIE_SERVE_DEADLINE_S)" in log, log[-3000:]
    assert "start the extract-server service (`eyrie serve-extract`) and check its log" in log
    assert worker.poll() is None


@FILE_STORE
def test_a_server_that_died_is_named_dead_not_a_connection_error(env, planned, workers):
    url = f"http://127.0.0.1:{free_port()}"  # published ready, then its process died: the port refuses
    _publish(planned, url)
    _start_extract_worker(workers, env, 12)
    _waiting_for(env, f"the vLLM extraction server at {url} (state: dead: connection refused at 127.0.0.1:",
                 "last seen", "at most 12 s")
    wait_for(lambda: _job(planned).get_status() == "scheduled", "the attempt failed and scheduled again", 60)
    log = workers.log_text("extract")
    assert f"the vLLM extraction server at {url} (state: dead: connection refused" in log, log[-3000:]
    assert "is dead, and no extraction server became ready within 12 s (EYRIE_SERVE_DEADLINE_S)" in log
    assert "Connection error" not in log


@FILE_STORE
def test_a_server_that_dies_while_a_shard_extracts_is_named_dead(env, planned, workers):
    """Ready when the task looked (published, republished, accepting connections), gone at the first
    request: the task fails naming the server dead once the client's retries are spent."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    died = threading.Event()

    def die_at_first_request():
        while True:
            conn, _ = listener.accept()
            with conn:
                if conn.recv(4):  # a request (the task's probe only connects)
                    listener.close()
                    died.set()
                    return

    def republish():  # as `eyrie serve-extract` does while its server is up
        while not died.wait(2):
            _publish(planned, url)

    _publish(planned, url)
    for target in (die_at_first_request, republish):
        threading.Thread(target=target, daemon=True).start()
    try:
        _start_extract_worker(workers, env, 600)
        wait_for(lambda: _job(planned).get_status() == "scheduled", "the attempt failed and scheduled again", 120)
    finally:
        died.set()
    log = workers.log_text("extract")
    assert (f"the vLLM extraction server at {url} (state: dead: connection refused at 127.0.0.1:" in log
            and "stopped answering while extract shard 0 ran" in log), log[-3000:]
    assert "each attempt waits for the server for at most EYRIE_SERVE_DEADLINE_S" in log


@FILE_STORE
def test_a_cancel_ends_the_wait(env, planned, workers):
    worker = _start_extract_worker(workers, env, 600)
    _waiting(env)
    cancelled_at = time.monotonic()
    eyrie("cancel", RUN, env=env)
    wait_for(lambda: _extract(env)["state"] == "cancelled", "the extract stage cancelled", timeout=30)
    assert time.monotonic() - cancelled_at < 30
    job = _job(planned)
    assert job.get_status() == "finished" and job.return_value()["status"] == "cancelled"
    assert worker.poll() is None  # the worker outlives the cancel, free for the next run's tasks


@FILE_STORE
def test_sigterm_ends_the_wait_so_the_worker_stops_and_hands_the_task_back(env, planned, workers):
    worker = _start_extract_worker(workers, env, 600)
    _waiting(env)
    worker.send_signal(signal.SIGTERM)  # what `docker stop` sends
    assert worker.wait(30) == 0  # warm shutdown: the wait ended, the worker stopped
    workers.procs["extract"].remove(worker)
    log = workers.log_text("extract")
    assert f"handed back {TASK}" in log and "internal error" not in log, log[-3000:]
    job = _job(planned)
    assert job.get_status() == "queued" and job.retries_left == 3  # back in the queue at once, no failure counted
    _start_extract_worker(workers, env, 600)  # the next worker takes it up again
    _waiting_for(env, "the vLLM extraction server (state: never published)")


def test_the_published_servers_health(redis_url):
    conn = redis.Redis.from_url(redis_url)
    listener = socket.create_server(("127.0.0.1", 0))
    live, dead = f"http://127.0.0.1:{listener.getsockname()[1]}", f"http://127.0.0.1:{free_port()}"
    cases = [(None, "never published"), ((live, "starting", 0), "starting"), ((live, "stopped", 0), "stopped"),
             ((live, "ready", 0), "ready"), ((live, "failed", 0), "dead: its vLLM exited"),
             ((live, "ready", 120), "dead: not republished for over 30 s"),
             ((dead, "ready", 0), "dead: connection refused at 127.0.0.1:")]
    for published, expected in cases:
        conn.delete(keys.EXTRACT_ENDPOINT)
        if published:
            _publish(conn, published[0], published[1], published[2])
        assert health(inference.read_extract(conn), time.time()).startswith(expected), published
    listener.close()


def test_the_wait_returns_a_ready_server_and_stops_on_a_cancel(redis_url):
    conn = redis.Redis.from_url(redis_url)
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    shown = []
    threading.Timer(1.5, lambda: _publish(conn, url)).start()
    assert ServerWait(conn, 30, shown.append, lambda: False, 3600).ready().url == url
    assert shown and shown[0].startswith("the vLLM extraction server (state: never published), for at most 30 s")
    listener.close()
    with pytest.raises(Cancelled):
        ServerWait(conn, 30, shown.append, lambda: True, 3600).ready()
    with pytest.raises(EyrieError, match=r"is dead, and no extraction server became ready within 1 s"):
        ServerWait(conn, 1, shown.append, lambda: False, 3600).ready()
