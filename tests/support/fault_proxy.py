"""Faults on the wire between two real parts (the servers behind it are real; only the network
misbehaves). Used by tests/e2e/test_faults.py.

http: a reverse proxy in front of the inference server. A share `--rate` of requests gets, in
      turn, a 5xx, a hang past the client's timeout, its connection dropped before any answer, or
      its connection dropped mid-answer; the rest are forwarded, each POST after `--delay-s` (a
      slow server). GET /_faults: the counts.
tcp:  a byte relay in front of the S3 server. SIGUSR1: down (listener closed, open connections
      cut: the server looks stopped); SIGUSR2: up again on the same port.

    python tests/support/fault_proxy.py http --port 9001 --upstream http://127.0.0.1:8000 --rate 0.2
    python tests/support/fault_proxy.py tcp --port 9002 --upstream 127.0.0.1:5000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
from collections import Counter

import aiohttp
from aiohttp import web

FAULTS = ("http_503", "hang", "drop", "drop_mid_answer")


def http_app(upstream: str, rate: float, hang_s: float, seed: int, delay_s: float = 0.0) -> web.Application:
    rng, counts, turn = random.Random(seed), Counter(), [0]
    hop = {"host", "content-length", "transfer-encoding", "connection"}

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = None
        if request.method == "POST" and rng.random() < rate:
            fault, turn[0] = FAULTS[turn[0] % len(FAULTS)], turn[0] + 1
            counts[fault] += 1
        if fault == "http_503":
            return web.Response(status=503, text='{"error": "injected 503"}')
        if fault == "hang":
            await asyncio.sleep(hang_s)
        if fault in ("hang", "drop"):
            request.transport.close()
            return web.Response(status=500)
        if request.method == "POST" and delay_s:
            await asyncio.sleep(delay_s)
        async with request.app["session"].request(
                request.method, upstream + request.path_qs, data=body,
                headers={k: v for k, v in request.headers.items() if k.lower() not in hop}) as up:
            data = await up.read()
        counts["forwarded" if request.method == "POST" else "other"] += 1
        if fault == "drop_mid_answer":
            out = web.StreamResponse(status=up.status, headers={"Content-Length": str(len(data)),
                                                                 "Content-Type": up.content_type})
            await out.prepare(request)
            await out.write(data[: len(data) // 2])
            request.transport.close()
            return out
        return web.Response(status=up.status, body=data, content_type=up.content_type)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(dict(counts))

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_get("/_faults", stats)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


class TcpRelay:
    def __init__(self, port: int, upstream: str):
        self.port, (self.host, up_port) = port, upstream.rsplit(":", 1)
        self.up_port, self.server, self.open = int(up_port), None, set()

    async def up(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def down(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self.open):
                writer.transport.abort()
            await self.server.wait_closed()
            self.server = None

    async def _relay(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.up_port)
        except OSError:
            writer.transport.abort()
            return
        self.open.update({writer, up_writer})
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self.open.difference_update({writer, up_writer})

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if writer.transport:
                writer.transport.abort()


async def run_tcp(port: int, upstream: str) -> None:
    relay, loop = TcpRelay(port, upstream), asyncio.get_running_loop()
    await relay.up()
    loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(relay.down()))
    loop.add_signal_handler(signal.SIGUSR2, lambda: asyncio.ensure_future(relay.up()))
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["http", "tcp"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--rate", type=float, default=0.2)
    parser.add_argument("--hang-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--delay-s", type=float, default=0.0)
    a = parser.parse_args()
    if a.mode == "http":
        web.run_app(http_app(a.upstream.rstrip("/"), a.rate, a.hang_s, a.seed, a.delay_s), host="127.0.0.1", port=a.port,
                    print=None)
    else:
        asyncio.run(run_tcp(a.port, a.upstream))


if __name__ == "__main__":
    main()
