"""Where the target is served: the inference service publishes, workers read, status shows."""

from __future__ import annotations

import time

import orjson
import redis
from pydantic import BaseModel

from eyrie.core.errors import EyrieError
from eyrie.work import keys
from eyrie.work.cancel import Stopping
from eyrie.work.gpu_wait import GpuWait


class Endpoint(BaseModel):
    name: str = "default"
    url: str
    model: str  # the name requests must carry (vLLM: served model name; transformers: the path)
    server: str  # vllm | transformers
    state: str  # waiting (for the GPUs) | starting | ready | stopped | failed
    max_model_len: int | None = None
    revision: str = "unresolved"
    chat_template_sha256: str | None = None
    progress: str = ""  # last load-progress line the server printed
    weight: int = 1  # its share of the requests in flight, against the other ready endpoints
    host: str = ""
    pid: int | None = None
    updated_at: float = 0.0
    run: str | None = None  # the run it is served for (`eyrie serve --run active`): its generation holds it


WAITING_FRESH_S = 30.0  # a server waiting for the GPUs republishes every few seconds: older, it is gone
TURN_S = 60.0  # the longest a generate task waits its turn in its worker before it hands itself back


class WaitingTurn(Stopping):
    """Another run's generation holds the stack's inference server (eyrie.runs.serve_turns): the
    task goes back to its queue (handed back: no attempt counted, no failure, not one of its stop
    hand-backs) so that its worker takes other tasks meanwhile, and waits its turn there."""

    counted = False


def waiting_for_gpus(endpoint: Endpoint | None, now: float) -> bool:
    """A published server alive and waiting for the GPUs (its last word fresh)."""
    return endpoint is not None and endpoint.state == "waiting" and now - endpoint.updated_at < WAITING_FRESH_S


def publish(conn: redis.Redis, endpoint: Endpoint) -> None:
    endpoint.updated_at = time.time()
    conn.set(keys.inference_endpoint(endpoint.name), orjson.dumps(endpoint.model_dump()))


def read(conn: redis.Redis, name: str = "default") -> Endpoint | None:
    raw = conn.get(keys.inference_endpoint(name))
    return Endpoint.model_validate(orjson.loads(raw)) if raw else None


def read_all(conn: redis.Redis) -> list[Endpoint]:
    names = sorted(keys.endpoint_name(k.decode()) for k in conn.scan_iter(keys.inference_endpoint("*")))
    return [e for e in (read(conn, name) for name in names) if e]


def wait_ready(conn: redis.Redis, deadline_s: float, name: str = "default") -> Endpoint:
    """The published endpoint once it is ready; a clear error if it isn't by the deadline."""
    return wait_all_ready(conn, deadline_s, name)[0]


def wait_all_ready(conn: redis.Redis, deadline_s: float, name: str = "default") -> list[Endpoint]:
    """Every ready endpoint once one is (the default first where it is ready)."""
    def ready() -> tuple[list[Endpoint], Endpoint | None]:
        endpoints = sorted((e for e in read_all(conn) if e.state == "ready"), key=lambda e: e.name != name)
        return endpoints, None if endpoints else read(conn, name)

    return _wait_ready(ready, deadline_s, "no ready inference endpoint",
                       "start it with `eyrie serve`, or set EYRIE_INFERENCE_URL to a running "
                       "OpenAI-compatible server.")


def wait_serving(conn: redis.Redis, deadline_s: float, serves, target: str, *, gpu_wait_s: float,
                 stop=None, holder=None) -> list[Endpoint]:
    """Every ready endpoint that serves a run's target (`serves(endpoint)`), once one does (the
    default first): a run whose target is not served waits for its server, whatever else is up
    meanwhile (another run's target), and never asks a server of another target. `stop()`: give up
    early (a cancelled run); it raises what it likes. While the target's server is alive and waiting
    for the GPUs (another run's later stages hold them), that is the task's wait for the GPUs
    (eyrie.work.gpu_wait: `gpu_wait_s`, EYRIE_GPU_WAIT_S, in all; a slice per RQ job) and
    `deadline_s` counts from when it is not.
    `holder()`: the run whose generation holds the stack's server meanwhile, if any (eyrie.runs.
    serve_turns.holder): the deadline does not count either, and after min(deadline_s, TURN_S) of
    it the task hands itself back (WaitingTurn)."""
    turn = _Turn(holder, min(deadline_s, TURN_S))
    says = ""  # what the server waiting for the GPUs says it waits for (who holds them)
    gpus = GpuWait(gpu_wait_s, lambda: f"the GPUs its server of {target} waits for ({says})")

    def ready() -> tuple[list[Endpoint], str, bool]:
        nonlocal says
        if stop is not None:
            stop()
        published, now = read_all(conn), time.time()
        serving = sorted((e for e in published if e.state == "ready" and serves(e)), key=lambda e: e.name != "default")
        others = ", ".join(f"{e.name}: {e.model} ({e.state})" for e in published) or "never published"
        coming = [e for e in published if serves(e) and waiting_for_gpus(e, now)]
        if coming and not serving:
            says = coming[0].progress or "waiting"
            gpus.check(conn)
        else:
            gpus.over()
        return serving, others, bool(coming) or (not serving and turn.waiting())

    return _wait_ready(ready, deadline_s, f"no ready inference endpoint serves the run's target {target}",
                       f"serve the run's target (`eyrie serve --model {target}`, or the run's config: "
                       "`eyrie serve --config RUN.yaml`) under its own EYRIE_ENDPOINT_NAME, or raise "
                       "EYRIE_SERVE_DEADLINE_S.", what="published")


class _Turn:
    """A wait for the server while another run's generation holds it: true while it does, raising
    WaitingTurn once it has for `limit_s` on end."""

    def __init__(self, holder, limit_s: float):
        self.holder, self.limit_s, self.since = holder, limit_s, None

    def waiting(self) -> bool:
        held_by = self.holder() if self.holder is not None else None
        if held_by is None:
            self.since = None
            return False
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since >= self.limit_s:
            raise WaitingTurn(f"run {held_by}'s generation holds the inference server (another target): "
                              "the task waits its turn in its queue")
        return True


def _wait_ready(ready, deadline_s: float, missing: str, fix: str, what: str = "state"):
    """Poll `ready()` (what is ready, and the endpoint whose state the error names, or that text;
    and optionally whether a server is on its way, which restarts the deadline) every second until
    it finds something; past the deadline, an error naming what is missing and that state."""
    limit = time.monotonic() + deadline_s
    while True:
        found, endpoint, *coming = ready()
        if found:
            return found
        if any(coming):
            limit = time.monotonic() + deadline_s
        if time.monotonic() > limit:
            state = endpoint if isinstance(endpoint, str) else endpoint.state if endpoint else "never published"
            raise EyrieError(f"{missing} after {deadline_s:g} s ({what}: {state}).", fix)
        time.sleep(1.0)


def publish_extract(conn: redis.Redis, endpoint: Endpoint) -> None:
    endpoint.updated_at = time.time()
    conn.set(keys.EXTRACT_ENDPOINT, orjson.dumps(endpoint.model_dump()))


def read_extract(conn: redis.Redis) -> Endpoint | None:
    raw = conn.get(keys.EXTRACT_ENDPOINT)
    return Endpoint.model_validate(orjson.loads(raw)) if raw else None
