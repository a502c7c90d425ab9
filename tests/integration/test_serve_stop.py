"""A stop of `eyrie serve` is seen as a worker's is (issue 41, item 11): its SIGTERM sets
eyrie.work.cancel.STOP_REQUESTED, so its last Redis commands (the endpoint published `stopped`, the
GPU lease returned) fail at their first error instead of waiting out an away Redis, and the stop
ends within a stated bound whether Redis answers or not. A real `eyrie serve` process on a
redis-server of the test's own; tests/fake_vllm stands in for `vllm` (the stop is under test)."""

import os
import signal
import subprocess
import time

import pytest
import redis

from eyrie.work import inference
from eyrie_inference.server import Server
from tests.integration.test_worker_redis import OwnRedis
from tests.support.harness import BIN, OFFLINE, ROOT, TINY, wait_for
from tests.support.processes import free_port

pytestmark = pytest.mark.integration

STOPS_WITHIN_S = 10  # the fake vLLM exits at once; before, the stop retried each Redis command for a minute and more


def test_serve_sigtermed_with_its_redis_gone_stops_within_its_bound_saying_so(tmp_path):
    own_redis = OwnRedis(tmp_path)
    own_redis.start()
    log = tmp_path / "serve.log"
    env = {**os.environ, **OFFLINE, "EYRIE_REDIS_URL": own_redis.url, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    serve = subprocess.Popen([str(BIN / "eyrie"), "serve", "--server", "vllm", "--model", str(TINY),
                              "--port", str(free_port())], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        conn = redis.Redis.from_url(own_redis.url)
        wait_for(lambda: (e := inference.read(conn)) is not None and e.state == "ready" or serve.poll() is not None,
                 "the fake vLLM served", 60)
        assert serve.poll() is None, log.read_text()
        own_redis.kill()
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(Server.STOP_GRACE_S + 60)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - started
        text = log.read_text(errors="replace")
        assert took <= STOPS_WITHIN_S, f"the stop took {took:.0f} s:\n{text}"
        assert serve.returncode == 0 and "Redis did not answer" in text and "internal error" not in text, text
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        own_redis.kill()
