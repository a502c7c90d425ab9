"""A stand-in for vLLM's OpenAI server (vLLM cannot run here): fixed latency, canned answers,
scripted faults. Used by tests (vLLM's response shape, errors) and by bench/ (throughput).

    python tests/support/stub_openai.py --port 8011 --latency 1.0 --shape reasoning --tokens 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

from aiohttp import web

SHAPES = ("reasoning", "reasoning_content", "think_tags", "plain")


def make_app(latency: float, shape: str, tokens: int, faults: dict[str, list] | None = None) -> web.Application:
    """faults: last user message -> list of outcomes per attempt ("ok", an HTTP status, "drop");
    the last outcome repeats."""
    counts: Counter = Counter()
    flight = {"now": 0, "max": 0}
    faults = faults or {}
    half = max(1, tokens // 2)
    reasoning_text, answer_text = " ".join(["step"] * half), " ".join(["answer"] * (tokens - half))

    def answer(prompt: str, body: dict) -> bytes:
        message = {"role": "assistant", "content": f"{answer_text} [{prompt}]"}
        if shape == "reasoning":
            message["reasoning"] = reasoning_text
        elif shape == "reasoning_content":
            message["reasoning_content"] = reasoning_text
        elif shape == "think_tags":
            message["content"] = f"<think>{reasoning_text}</think>{message['content']}"
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        data = {"id": "cmpl-stub", "object": "chat.completion", "model": body.get("model"),
                "choices": [choice],
                "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens}}
        if body.get("return_token_ids"):
            data["prompt_token_ids"] = list(range(10))
            choice["token_ids"] = list(range(100, 100 + tokens))
        return json.dumps(data).encode()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "user"), "")
        counts[prompt] += 1
        plan = faults.get(prompt, ["ok"])
        outcome = str(plan[min(counts[prompt], len(plan)) - 1])
        flight["now"] += 1
        flight["max"] = max(flight["max"], flight["now"])
        try:
            await asyncio.sleep(latency)
        finally:
            flight["now"] -= 1
        if outcome == "drop":
            request.transport.close()
            return web.Response(status=500)
        if outcome != "ok":
            return web.Response(status=int(outcome), text=json.dumps({"error": f"stub {outcome}"}))
        return web.Response(body=answer(prompt, body), content_type="application/json")

    async def completion(request: web.Request) -> web.Response:
        """/v1/completions as verify asks it (token-id prompts, return_token_ids), after `latency`."""
        body = await request.json()
        n = min(tokens, body.get("max_tokens") or tokens)
        await asyncio.sleep(latency)
        choice = {"index": 0, "text": " ".join(["answer"] * n), "token_ids": list(range(100, 100 + n)),
                  "finish_reason": "length"}
        return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": body.get("model"),
                                  "choices": [choice], "usage": {"completion_tokens": n}})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"requests": dict(counts), "total": sum(counts.values()),
                                  "max_in_flight": flight["max"]})

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--shape", choices=SHAPES, default="reasoning")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--faults", help="JSON file: prompt -> outcomes per attempt")
    args = parser.parse_args()
    faults = json.load(open(args.faults)) if args.faults else None
    web.run_app(make_app(args.latency, args.shape, args.tokens, faults), host="127.0.0.1",
                port=args.port, print=None, access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
