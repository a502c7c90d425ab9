"""One chat completion, retried where a retry can help, parsed into what a record keeps."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from eyrie.core.errors import EyrieError

RETRY_STATUS = {408, 429}
UNAVAILABLE_STATUS = {502, 503, 504}  # what a proxy in front of a server answers while the server is away
CONTEXT_ERRORS = ("maximum context length", "context length", "too long", "exceeds the max")


@dataclass
class Completion:
    """What a record keeps of one answer (or why there is none)."""

    status: str  # done | skipped | failed
    reason: str | None = None
    error: str | None = None
    attempts: int = 0
    reasoning: str | None = None
    reasoning_source: str | None = None  # reasoning | reasoning_content | think_tags | None
    content: str | None = None
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    latency_s: float = 0.0


class RetryableError(Exception):
    pass


class Unavailable(RetryableError):
    """502/503/504: a proxy (a load balancer, vLLM's router) answering for a server that may be away."""


class ServerAway(EyrieError):
    """The server stayed away past the serve deadline."""


class ServerGate:
    """Whether one server is there to ask. A connection refused or reset, or a 502/503/504 (a proxy
    answering for it), is a question for the server: if it answers a probe (any HTTP answer below
    500 at /health), the request failed on its own; if not, the server is away (not up yet,
    restarting) and the gate closes: every lane waits at it, asking nothing and failing nothing,
    until the server answers again, for at most
    `deadline_s` (EYRIE_SERVE_DEADLINE_S); then ServerAway. `stop()` ends a wait early by raising
    (a cancelled run)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, deadline_s: float, probe_every_s: float = 1.0,
                 stop=None):
        self.session, self.url, self.deadline_s = session, base_url, deadline_s
        self.probe_every_s, self.stop = probe_every_s, stop or (lambda: None)
        self.away_since: float | None = None
        self.reason = ""
        self._probing = asyncio.Lock()

    def waiting_for(self) -> str | None:
        """What the lanes wait for, as status shows it; None while the gate is open."""
        if self.away_since is None:
            return None
        away = time.monotonic() - self.away_since
        return (f"the inference server at {self.url}, not answering for {away:.0f} s ({self.reason[:120]}); "
                f"waiting at most {self.deadline_s:g} s (EYRIE_SERVE_DEADLINE_S)")

    async def closes_on(self, error: str) -> bool:
        """After a connection error: True (the gate is closed now) when the server does not answer."""
        if self.away_since is None:
            if await self._answers():
                return False
            if self.away_since is None:
                self.away_since, self.reason = time.monotonic(), error
        return True

    async def passage(self) -> None:
        """Returns at once while the server is there; else once it answers again. One lane probes
        at a time, once every probe_every_s; the others wait their turn and find the gate open."""
        while self.away_since is not None:
            async with self._probing:
                if self.away_since is None:
                    return
                self.stop()
                if await self._answers():
                    self.away_since = None
                    return
                if time.monotonic() - self.away_since > self.deadline_s:
                    raise ServerAway(f"the inference server at {self.url} did not answer for {self.deadline_s:g} s "
                                     f"({self.reason}).", "start it (or check EYRIE_INFERENCE_URL), or raise "
                                     "EYRIE_SERVE_DEADLINE_S; the task is retried and asks only what is missing.")
                await asyncio.sleep(self.probe_every_s)

    async def _answers(self) -> bool:
        try:
            async with self.session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status < 500
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False


class ChatClient:
    """Chat completions against an OpenAI-compatible server (vLLM or `transformers serve`)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, server: str,
                 sampling: dict, timeout_s: float, max_retries: int, think: tuple[str, str],
                 backoff_s: float = 1.0, gate: "ServerGate | None" = None):
        self.gate = gate or ServerGate(session, base_url, deadline_s=3600.0)
        self.session, self.url, self.model = session, f"{base_url}/v1/chat/completions", model
        self.server, self.sampling, self.max_retries, self.think = server, sampling, max_retries, think
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.backoff_s = backoff_s
        # vLLM returns the exact token ids when asked; transformers serve rejects the field (422)
        self.ask_token_ids = server == "vllm"

    def body(self, messages: list[dict], max_tokens: int) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": False,
                **{k: v for k, v in self.sampling.items() if v is not None and k != "max_tokens"}}
        if self.ask_token_ids:
            body["return_token_ids"] = True
        return body

    async def complete(self, messages: list[dict], max_tokens: int) -> Completion:
        """The answer, or the failure after max_retries retries. A connection refused or reset, or
        a 502/503/504 from a proxy in front of it, while the server does not answer is no attempt:
        the lane waits at `gate` for the server."""
        started, last_error, attempt = time.monotonic(), "", 0
        while attempt <= self.max_retries:
            await self.gate.passage()
            attempt += 1
            try:
                asked = self.ask_token_ids
                result = await self._post(orjson.dumps(self.body(messages, max_tokens)))
                if result.status == "failed" and asked and "return_token_ids" in (result.error or ""):
                    self.ask_token_ids = False  # a server that rejects the field: never send it again
                    result = await self._post(orjson.dumps(self.body(messages, max_tokens)))
                result.attempts, result.latency_s = attempt, time.monotonic() - started
                return result
            except (Unavailable, aiohttp.ClientError) as exc:
                last_error = str(exc) if isinstance(exc, Unavailable) else f"{type(exc).__name__}: {exc}"
                if await self.gate.closes_on(last_error):
                    attempt -= 1  # the server is away, not this request's failure
                    continue
            except RetryableError as exc:
                last_error = str(exc)
            except asyncio.TimeoutError:
                last_error = f"timeout after {self.timeout.total:.0f} s"
            if attempt <= self.max_retries:
                await asyncio.sleep(min(60.0, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5))
        return Completion("failed", error=last_error, attempts=attempt, latency_s=time.monotonic() - started)

    async def _post(self, payload: bytes) -> Completion:
        async with self.session.post(self.url, data=payload, timeout=self.timeout,
                                     headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            if resp.status == 200:
                return self.parse(raw)
            text = raw[:500].decode("utf-8", "replace")
            if resp.status in UNAVAILABLE_STATUS:
                raise Unavailable(f"HTTP {resp.status}: {text}")
            if resp.status in RETRY_STATUS or resp.status >= 500:
                raise RetryableError(f"HTTP {resp.status}: {text}")
            if resp.status == 400 and any(s in text.lower() for s in CONTEXT_ERRORS):
                return Completion("skipped", reason="prompt_too_long", error=f"HTTP 400: {text}")
            return Completion("failed", error=f"HTTP {resp.status}: {text}")

    def parse(self, raw: bytes) -> Completion:
        try:
            data = orjson.loads(raw)
            choice = data["choices"][0]
            message = choice["message"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return Completion("failed", error=f"malformed response: {raw[:200]!r}")
        reasoning, source, content = split_reasoning(message, self.think)
        return Completion(
            "done", reasoning=reasoning, reasoning_source=source, content=content,
            finish_reason=choice.get("finish_reason"), usage=data.get("usage") or {},
            prompt_token_ids=data.get("prompt_token_ids") or choice.get("prompt_token_ids"),
            completion_token_ids=choice.get("token_ids"),
        )


def split_reasoning(message: dict, think: tuple[str, str]) -> tuple[str | None, str | None, str]:
    """Reasoning from `reasoning` (vLLM), `reasoning_content` (transformers serve, older vLLM)
    or inline think markers in the content; returns (reasoning, where it was found, content)."""
    content = message.get("content") or ""
    for field_name in ("reasoning", "reasoning_content"):
        if message.get(field_name):
            return message[field_name], field_name, content
    start, end = think
    if end in content:  # "<think>r</think>a", or "r</think>a" when the template opened the tag
        before, _, answer = content.partition(end)
        return before.split(start, 1)[-1], "think_tags", answer
    return None, None, content
