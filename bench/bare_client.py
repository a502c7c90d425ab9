"""The floor: the least a Python asyncio client can do per request, as a reference row.

C lanes over one aiohttp session post the same body eyrie sends (vLLM, return_token_ids), read
the answer and parse it with orjson; nothing is kept or written. What it cannot reach on a
machine, no client in one Python process will.

    python bench/bare_client.py --url http://127.0.0.1:8011 --prompts F.jsonl --concurrency 200 --max-tokens 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import orjson


async def main_async(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    bodies = iter(orjson.dumps({"model": "stub", "messages": [{"role": "user", "content": p}],
                                "max_tokens": max_tokens, "stream": False, "return_token_ids": True})
                  for p in prompts)
    done = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def lane() -> None:
            nonlocal done
            for body in bodies:
                async with session.post(f"{url}/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    data = orjson.loads(await resp.read())
                    assert resp.status == 200 and data["choices"][0]["token_ids"]
                    done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return {"done": done, "wall_s": time.monotonic() - t0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompts", required=True, help="ShareGPT JSONL")
    parser.add_argument("--concurrency", type=int, required=True, help="Requests in flight (generate_throughput "
                                                                      "passes its own --concurrency).")
    parser.add_argument("--max-tokens", type=int, default=1000)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = [json.loads(line)["conversations"][-1]["value"] for line in f]
    result = asyncio.run(main_async(args.url, prompts, args.concurrency, args.max_tokens))
    print(f"Bare client: {result['done']} done in {result['wall_s']:.3f} s")


if __name__ == "__main__":
    main()
