"""tests/support/stub_openai.py unchanged, plus a server-side clock: the same ruler for every client.

A middleware around POST /v1/chat/completions records when the first request arrived, when the
last one was answered, and the time-weighted number of requests inside the handler (in flight
at the server). GET /bench-stats returns them (?events=1: also every arrival and answer time);
GET /stats (the stub's own) counts the requests per prompt.

    python bench/timed_stub.py --port 8011 --latency 1.0 --shape reasoning --tokens 1000
"""

from __future__ import annotations

import argparse
import time

from aiohttp import web

from tests.support.stub_openai import SHAPES, make_app

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.area = 0.0  # integral of in_flight dt, from the first arrival on
        self.last_t: float | None = None
        self.requests = 0
        self.answered = 0
        self.events: list[tuple[float, int]] = []  # (monotonic time, +1 arrival / -1 answer)

    def tick(self, delta: int) -> None:
        now = time.monotonic()
        self.events.append((now, delta))
        if self.first_start is None:
            self.first_start = self.last_t = now
        self.area += self.in_flight * (now - self.last_t)
        self.last_t, self.in_flight = now, self.in_flight + delta
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if delta > 0:
            self.requests += 1
        else:
            self.answered += 1
            self.last_end = now

    def stats(self) -> dict:
        if self.first_start is None or self.last_end is None:
            return {"requests": self.requests, "answered": self.answered, "window_s": 0.0,
                    "mean_in_flight": 0.0, "max_in_flight": self.max_in_flight}
        window = max(1e-9, self.last_end - self.first_start)
        # area up to the last answer: later ticks (none, if all answered) are not in the window
        return {"requests": self.requests, "answered": self.answered, "window_s": window,
                "mean_in_flight": self.area / window, "max_in_flight": self.max_in_flight,
                "first_start_mono": self.first_start, "last_end_mono": self.last_end}


def timed_app(latency: float, shape: str, tokens: int) -> web.Application:
    clock = Clock()

    @web.middleware
    async def timing(request: web.Request, handler):
        if request.path != CHAT:
            return await handler(request)
        clock.tick(+1)
        try:
            return await handler(request)
        finally:
            clock.tick(-1)

    async def bench_stats(request: web.Request) -> web.Response:
        stats = clock.stats()
        if request.query.get("events"):
            stats["events"] = clock.events
        return web.json_response(stats)

    app = make_app(latency, shape, tokens)
    app.middlewares.append(timing)
    app.router.add_get("/bench-stats", bench_stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--shape", choices=SHAPES, default="reasoning")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    web.run_app(timed_app(args.latency, args.shape, args.tokens), host="127.0.0.1", port=args.port,
                print=None, access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
