"""The stack's vLLM extraction server as its clients see it: extract tasks of the vLLM backend,
and the train task of a run whose hidden states are made during training (extract.storage hybrid
or online). `eyrie serve-extract` publishes the server in Redis (eyrie.work.inference.publish_extract);
EYRIE_EXTRACT_VLLM_URL names one instead.

A task's wait says in its live progress what it waits for (`eyrie status`: the server's state
and when it last published itself), gives up after EYRIE_SERVE_DEADLINE_S with an error naming the
problem and the fix (while the server waits for the GPUs, the task waits for them under
eyrie.work.gpu_wait's rule instead: EYRIE_GPU_WAIT_S in all), and ends early on a cancel of the
run (`Cancelled`: the task ends cancelled) or on the worker's warm shutdown (SIGTERM: `WorkerStopping`; the task is handed back to its queue). A server that
was ready and is not any more (state failed, no longer republished, its port refusing
connections) is named dead, and so is one that stops answering in the middle of a shard.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

from eyrie.core.errors import EyrieError
from eyrie.work import inference
from eyrie.work.cancel import Cancelled, Stopping
from eyrie.work.gpu_wait import GpuWait
from eyrie.work.inference import Endpoint
from eyrie.work.queue import RETRY_INTERVALS_S
from eyrie.work.worker_loop import stop_requested

STALE_AFTER_S = 30.0  # a ready server republishes itself every 5 s (eyrie_inference.server.Server.POLL_S)
POLL_S = 1.0
BOUND = "EYRIE_SERVE_DEADLINE_S"
FIX = ("start the extract-server service (`eyrie serve-extract`) and check its log: vLLM's last lines "
       "say why it did not start or stopped; or set EYRIE_EXTRACT_VLLM_URL to a running one "
       f"(docs/vllm-extraction.md). A target that loads longer needs a larger {BOUND}.")


class WorkerStopping(Stopping):
    """The worker was asked to stop (SIGTERM) while the task waited: the task goes back to its queue."""


def health(endpoint: Endpoint | None, now: float) -> str:
    """`ready`, or what the published server is instead: never published, starting, stopped, or
    `dead: <why>` for one that was ready and is not any more."""
    if endpoint is None:
        return "never published"
    if endpoint.state == "failed":
        return "dead: its vLLM exited"
    if endpoint.state != "ready":
        return endpoint.state
    if now - endpoint.updated_at > STALE_AFTER_S:
        return f"dead: not republished for over {STALE_AFTER_S:g} s, its `eyrie serve-extract` is gone"
    refused = connect_error(endpoint.url)
    return f"dead: {refused}" if refused else "ready"


def connect_error(url: str) -> str | None:
    """Why nothing accepts a connection at `url` (e.g. `connection refused at HOST:PORT`); None if something does."""
    parsed = urlparse(url)
    address = (parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80))
    try:
        with socket.create_connection(address, timeout=2):
            return None
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        return f"{why.lower()} at {address[0]}:{address[1]}"


def describe(endpoint: Endpoint | None, state: str, now: float) -> str:
    """`the vLLM extraction server at URL (state: X, last seen N s ago)`."""
    if endpoint is None:
        return f"the vLLM extraction server (state: {state})"
    return (f"the vLLM extraction server at {endpoint.url} (state: {state}, "
            f"last seen {max(0.0, now - endpoint.updated_at):.0f} s ago)")


def gave_up(endpoint: Endpoint | None, state: str, now: float, deadline_s: float) -> EyrieError:
    """The error past the bound: a dead server named dead, else that none became ready."""
    seen = describe(endpoint, state, now)
    bound = f"within {deadline_s:g} s ({BOUND})"
    if state.startswith("dead"):
        return EyrieError(f"{seen} is dead, and no extraction server became ready {bound}.", FIX)
    return EyrieError(f"no vLLM extraction server became ready {bound}; {seen}.", FIX)


class ServerWait:
    """One task's wait for the published server. `report(text)`: show what it waits for;
    `cancelled()`: true once the run is cancelled; `gpu_wait_s` (EYRIE_GPU_WAIT_S): the bound of
    its wait while the server waits for the GPUs (eyrie.work.gpu_wait)."""

    def __init__(self, conn, deadline_s: float, report: Callable[[str], None], cancelled: Callable[[], bool],
                 gpu_wait_s: float):
        self.conn, self.deadline_s, self.report, self.cancelled = conn, deadline_s, report, cancelled
        self.gpu_wait_s = gpu_wait_s

    def ready(self) -> Endpoint:
        """The published server once it is ready; raises past the bound, on a cancel or a SIGTERM.
        While the server waits for the GPUs, that is the task's wait for them (eyrie.work.gpu_wait:
        EYRIE_GPU_WAIT_S in all, a slice per RQ job), and the bound counts from when it is not."""
        limit, seen = time.monotonic() + self.deadline_s, ""
        gpus = GpuWait(self.gpu_wait_s, lambda: seen)
        while True:
            self._stop_if_asked()
            endpoint, now = inference.read_extract(self.conn), time.time()
            state = health(endpoint, now)
            if state == "ready":
                gpus.over()
                return endpoint
            seen = describe(endpoint, state, now)
            if inference.waiting_for_gpus(endpoint, now):
                seen += f": {endpoint.progress or 'waiting for the GPUs'}"
                gpus.check(self.conn)
                limit = time.monotonic() + self.deadline_s
                self.report(f"{seen}, for at most {self.gpu_wait_s:g} s in all (EYRIE_GPU_WAIT_S)")
            else:
                gpus.over()
                if time.monotonic() >= limit:
                    raise gave_up(endpoint, state, now, self.deadline_s)
                self.report(f"{seen}, for at most {self.deadline_s:g} s ({BOUND})")
            time.sleep(POLL_S)

    def _stop_if_asked(self) -> None:
        if self.cancelled():
            raise Cancelled("the run was cancelled while its task waited for the vLLM extraction server")
        if stop_requested():
            raise WorkerStopping("the worker is stopping (SIGTERM) while this task waited for the vLLM "
                                 "extraction server: it goes back to its queue")


def server_url(settings, conn, report: Callable[[str], None], cancelled: Callable[[], bool]) -> str:
    """EYRIE_EXTRACT_VLLM_URL, else the server `eyrie serve-extract` published, waited for (ServerWait)."""
    if settings.extract_vllm_url:
        return settings.extract_vllm_url
    return ServerWait(conn, settings.serve_deadline_s, report, cancelled, settings.gpu_wait_s).ready().url


def api_base(url: str) -> str:
    """The server's OpenAI API root: its URL with /v1 (vLLM serves the API there)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def stopped_answering(conn, url: str, failure: Exception, shard: int) -> EyrieError | None:
    """After a request to the server at `url` failed: the error naming that server dead or gone,
    if it is (None: it is up, and the failure is the request's own)."""
    endpoint, now = inference.read_extract(conn), time.time()
    if endpoint is not None and endpoint.url.rstrip("/") == url.rstrip("/"):
        state = health(endpoint, now)
    else:  # configured by EYRIE_EXTRACT_VLLM_URL, or another server published since
        refused, endpoint = connect_error(url), None
        state = f"dead: {refused}" if refused else "ready"
    if state == "ready":
        return None
    seen = describe(endpoint, state, now) if endpoint else f"the vLLM extraction server at {url} (state: {state})"
    retries = ", ".join(f"{s} s" for s in RETRY_INTERVALS_S)
    return EyrieError(f"{seen} stopped answering while extract shard {shard} ran ({failure}).",
                      f"{FIX} The task is retried ({retries} later) and each attempt waits for the server "
                      f"for at most {BOUND}.")


def on_demand(sample: dict) -> bool:
    """A stored extract sample (its shard manifest's record) whose object holds its token ids alone
    (`states: false`): training asks the extraction service for its hidden states (extract.storage
    hybrid or online). Absent or true: the object holds its states."""
    return sample.get("states", True) is False
