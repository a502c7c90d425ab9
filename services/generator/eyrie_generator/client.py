"""One chat completion, retried where a retry can help, parsed into what a record keeps."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

RETRY_STATUS = {408, 429}
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


class ChatClient:
    """Chat completions against an OpenAI-compatible server (vLLM or `transformers serve`)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, server: str,
                 sampling: dict, timeout_s: float, max_retries: int, think: tuple[str, str],
                 backoff_s: float = 1.0):
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
        started, last_error = time.monotonic(), ""
        for attempt in range(1, self.max_retries + 2):
            try:
                asked = self.ask_token_ids
                result = await self._post(orjson.dumps(self.body(messages, max_tokens)))
                if result.status == "failed" and asked and "return_token_ids" in (result.error or ""):
                    self.ask_token_ids = False  # a server that rejects the field: never send it again
                    result = await self._post(orjson.dumps(self.body(messages, max_tokens)))
                result.attempts, result.latency_s = attempt, time.monotonic() - started
                return result
            except RetryableError as exc:
                last_error = str(exc)
            except asyncio.TimeoutError:
                last_error = f"timeout after {self.timeout.total:.0f} s"
            except aiohttp.ClientError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if attempt <= self.max_retries:
                await asyncio.sleep(min(60.0, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5))
        return Completion("failed", error=last_error, attempts=self.max_retries + 1,
                          latency_s=time.monotonic() - started)

    async def _post(self, payload: bytes) -> Completion:
        async with self.session.post(self.url, data=payload, timeout=self.timeout,
                                     headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            if resp.status == 200:
                return self.parse(raw)
            text = raw[:500].decode("utf-8", "replace")
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
