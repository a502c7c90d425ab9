"""A run whose target no ready server serves waits for one (its status says so) instead of failing
its generate tasks, and never sends a request to a server of another target (issue 21, item 8):
a real generate worker against two stub servers, one per target, published in Redis."""

import json
import shutil

import pytest
import redis
import requests

from eyrie.core.target import describe
from eyrie.work import inference
from tests.support.builders import publish_endpoint
from tests.support.harness import TINY, TRAIN_PROMPTS, eyrie, wait_for

DB = 12  # our own database: the endpoints published here reach no other test


def _other_target(tmp_path):
    other = tmp_path / "other-target"
    shutil.copytree(TINY, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "eyrie_note": 1}', 1))
    return other


def _generate_state(run: str, env: dict) -> dict:
    return json.loads(eyrie("status", run, "--json", env=env).stdout)["stages"]["generate"]


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_run_waits_for_a_server_of_its_target_and_says_so(env, stub_server, workers, tmp_path):
    url = env["EYRIE_REDIS_URL"].rsplit("/", 1)[0] + f"/{DB}"
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    env = workers.env = {**env, "EYRIE_REDIS_URL": url, "EYRIE_MODEL": str(TINY), "EYRIE_SERVE_DEADLINE_S": "120"}
    eyrie("generate", "--dataset", str(TRAIN_PROMPTS), "--run", "mine", "--limit", "6", "--max-tokens", "8",
          env=env)  # planned while nothing is served
    other_url, mine_url = stub_server(tokens=4), stub_server(tokens=4)
    publish_endpoint(conn, str(_other_target(tmp_path)), other_url, name="other")  # another run's target, ready
    workers.start("generate")

    def waiting():
        status = _generate_state("mine", env)
        failed = status["state"] == "failed" or status["errors"] or "scheduled" in status["jobs"]
        assert not failed, f"the task failed instead of waiting: {status['jobs']} {status['errors']}"
        return any(w.startswith("a server for target") for w in status["waiting_for"])

    wait_for(waiting, "the generate stage waiting for a server of its target", timeout=60)
    status = _generate_state("mine", env)
    assert status["state"] == "in_progress" and status["jobs"] == {"started": 1}
    assert any(str(TINY) in w for w in status["waiting_for"]), status["waiting_for"]

    publish_endpoint(conn, str(TINY), mine_url, name="mine")  # its server comes up
    wait_for(lambda: _generate_state("mine", env)["state"] == "done", "the run generated", timeout=60)
    status = _generate_state("mine", env)
    assert (status["done"], status["failed"], status["waiting_for"]) == (6, 0, [])
    assert requests.get(f"{other_url}/stats").json()["requests"] == {}  # never asked the other target
    assert sum(requests.get(f"{mine_url}/stats").json()["requests"].values()) == 6


def test_the_wait_is_bounded_and_names_the_target_and_what_is_served(redis_server, tmp_path):
    """Past EYRIE_SERVE_DEADLINE_S the task fails with one message naming the run's target and
    the servers published (a retry waits again)."""
    from eyrie.core.errors import EyrieError
    from eyrie.core.target import same_target

    conn = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + f"/{DB}")
    conn.flushdb()
    other = _other_target(tmp_path)
    publish_endpoint(conn, str(other), "http://127.0.0.1:9", name="other")
    target = describe(str(TINY))
    with pytest.raises(EyrieError) as err:
        inference.wait_serving(conn, 1.5, lambda e: same_target(target, e), target.model, gpu_wait_s=3600)
    assert f"serves the run's target {TINY} after 1.5 s" in str(err.value)
    assert f"other: {other} (ready)" in str(err.value)
    publish_endpoint(conn, str(TINY), "http://127.0.0.1:10", name="mine")
    served = inference.wait_serving(conn, 1, lambda e: same_target(target, e), target.model, gpu_wait_s=3600)
    assert [e.name for e in served] == ["mine"]


def test_a_server_away_past_the_serve_deadline_fails_the_task_not_its_samples():
    """A server that never answers (nothing listens on its port): the request waits at the gate
    for EYRIE_SERVE_DEADLINE_S, then the task fails (retried later) instead of recording a failed
    sample."""
    import asyncio

    import aiohttp

    from tests.support.processes import free_port
    from eyrie_generator.client import ChatClient, ServerAway, ServerGate

    async def ask():
        async with aiohttp.ClientSession() as session:
            gate = ServerGate(session, f"http://127.0.0.1:{free_port()}", deadline_s=1.0, probe_every_s=0.2)
            client = ChatClient(session, gate.url, "m", "transformers", {}, 5, 3, ("<think>", "</think>"), 0.01, gate)
            return await client.complete([{"role": "user", "content": "q"}], 4)

    with pytest.raises(ServerAway, match="did not answer for 1 s"):
        asyncio.run(ask())


class _Restarting:
    """A real HTTP server standing for a proxy in front of a restarting inference server: its first
    `away` requests (completions and /health probes alike) get 503, then it answers. `health`:
    what /health answers meanwhile (a proxy: 503; a server that is up but overloaded: 200)."""

    def __init__(self, away: int, health: int = 503):
        import http.server
        import threading

        self.away, self.posts = away, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if outer.away > 0 and health >= 500:
                    outer.away -= 1
                    return self._answer(503, b'{"error": "upstream restarting"}')
                self._answer(200, b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts += 1
                if outer.away > 0:
                    outer.away -= 1
                    return self._answer(503, b'{"error": "upstream restarting"}')
                self._answer(200, json.dumps({"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}],
                                              "usage": {}}).encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ask(self, max_retries: int):
        import asyncio

        import aiohttp

        from eyrie_generator.client import ChatClient, ServerGate

        async def ask():
            async with aiohttp.ClientSession() as session:
                gate = ServerGate(session, self.url, deadline_s=30, probe_every_s=0.05)
                client = ChatClient(session, self.url, "m", "transformers", {}, 5, max_retries, ("<think>", "</think>"),
                                    0.01, gate)
                return await client.complete([{"role": "user", "content": "q"}], 4)

        try:
            return asyncio.run(ask())
        finally:
            self.server.shutdown()
            self.server.server_close()


def test_a_503_from_a_proxy_in_front_of_a_restarting_server_waits_and_costs_no_attempt():
    """Issue 41, item 12: the proxy answers 503 for the server while it restarts (its /health too),
    four times; with one retry allowed the sample used to fail after two 503s."""
    server = _Restarting(away=4)
    answer = server.ask(max_retries=1)
    assert answer.status == "done" and answer.attempts == 1, answer
    assert server.posts == 2  # the request cut off by the restart, then the one answered


def test_a_503_from_a_server_that_answers_its_health_probe_is_an_attempt():
    """The server itself is there (its /health answers) and refuses: a retry, counted as before."""
    server = _Restarting(away=2, health=200)
    answer = server.ask(max_retries=1)
    assert answer.status == "failed" and answer.attempts == 2 and "HTTP 503" in answer.error, answer
