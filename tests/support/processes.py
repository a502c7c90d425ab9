"""Local processes for tests and benchmarks: a free loopback port, a redis-server of the caller's, a stop."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after `timeout` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis(folder: Path, *, aof: bool = False, log: Path | None = None, new_session: bool = False,
                timeout: float = 10) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free loopback port, its files in `folder`: nothing persisted, or (aof) an
    append-only file; its log to `log` if given. Returns the process and its URL once it answers."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server is not installed: `make redis` installs it (apt-get install redis-server)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
            "--appendonly", "yes" if aof else "no", *(["--logfile", str(log)] if log else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if log else None,
                            start_new_session=new_session)
    url = f"redis://127.0.0.1:{port}/0"
    _wait_answers(proc, url, timeout, log)
    return proc, url


def _wait_answers(proc: subprocess.Popen, url: str, timeout: float, log: Path | None) -> None:
    conn = redis.Redis.from_url(url, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"redis-server did not answer at {url}" + (f" (see {log})" if log else ""))
            time.sleep(0.05)
