"""generate_throughput's ruler, the same for every client: a stand-in started per run, a command timed with its
process tree's CPU (wait4, and sampled on the stub's monotonic clock), the server's own counts of the window."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from tests.support.processes import free_port


ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            get_json(url, timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def start_stub(latency: float, tokens: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "timed_stub.py"), "--port", str(port),
                             "--latency", str(latency), "--shape", "reasoning", "--tokens", str(tokens)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    return proc, url


class TreeSampler(threading.Thread):
    """CPU seconds of a process tree, sampled every `period` s on the system-wide monotonic clock
    (the stub's clock too), so the CPU spent inside the server's request window can be read."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period, self.samples = pid, period, []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.done.is_set():
            try:
                t = root.cpu_times()
                total = t.user + t.system + t.children_user + t.children_system  # + reaped children
                for child in root.children(recursive=True):
                    try:
                        c = child.cpu_times()
                        total += c.user + c.system
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), total))
            self.done.wait(self.period)

    def cpu_between(self, t0: float, t1: float) -> float | None:
        if len(self.samples) < 2 or not (self.samples[0][0] <= t0 and t1 <= self.samples[-1][0]):
            return None
        return self._at(t1) - self._at(t0)

    def _at(self, t: float) -> float:
        for (ta, ca), (tb, cb) in zip(self.samples, self.samples[1:]):
            if ta <= t <= tb:
                return ca + (cb - ca) * (t - ta) / max(1e-9, tb - ta)
        return self.samples[-1][1]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), steal included."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def run_timed(cmd: list[str], env: dict, log: Path, timeout: float, sample: bool = False) -> dict:
    """Run a command; wall seconds and the CPU of its whole (reaped) process tree via wait4."""
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid) if sample else None
        if sampler:
            sampler.start()
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            if sampler:
                sampler.done.set()
                sampler.join()
        wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} (killed after {timeout:.0f} s?):\n"
                           f"{log.read_text(errors='replace')[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024,
            "sampler": sampler}


def server_side(url: str, n: int, concurrency: int) -> dict:
    stats = get_json(f"{url}/bench-stats?events=1")
    counts = get_json(f"{url}/stats")["requests"]
    stats["each_once"] = len(counts) == n and all(v == 1 for v in counts.values())
    stats["req_per_s"] = stats["answered"] / stats["window_s"] if stats["window_s"] else 0.0
    stats.update(losses(stats.pop("events"), concurrency))
    return stats


def losses(events: list, c: int) -> dict:
    """Where the window's C slots stood empty, in seconds of all C slots: before C requests had
    first arrived (ramp), after the last arrival (tail: the last answers trickle in), and between
    (turnaround: an answer left the handler, the client's next request had not yet arrived)."""
    events = sorted(events)
    if not events:
        return {"loss_ramp_s": 0.0, "loss_turnaround_s": 0.0, "loss_tail_s": 0.0}
    last_arrival = max(t for t, d in events if d > 0)
    lost = {"ramp": 0.0, "turnaround": 0.0, "tail": 0.0}
    in_flight, arrivals, prev = 0, 0, events[0][0]
    for t, d in events:
        phase = "ramp" if arrivals < c else ("tail" if prev >= last_arrival else "turnaround")
        lost[phase] += max(0, c - in_flight) * (t - prev)
        in_flight += d
        arrivals += d > 0
        prev = t
    return {f"loss_{k}_s": v / c for k, v in lost.items()}
