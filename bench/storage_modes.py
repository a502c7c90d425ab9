"""Storage modes measured: one target's answers, generated once, trained offline, hybrid and online through the real
vLLM extraction service, each drafter's acceptance measured by vLLM itself.

  .venv/bin/python bench/storage_modes.py --target tiny        (then --target smollm2; --help: every option)

What it does, in its own Redis, file store and work directory (--work), with the vLLM of EYRIE_VLLM_COMMAND (default
the project's .venv-vllm, vLLM's CPU build here): vLLM serves the target while eyrie generates answers to --prompts
prompts (run `g`), which are cloned into runs `offline`, `hybrid` and `online` (the same shard objects, as
tests/test_storage_modes.py does). vLLM's extraction service (CPU-safe connector) extracts each with `eyrie extract
--storage MODE` (hybrid: a budget of half the offline run's stored bytes), and `eyrie train` + `eyrie worker train`
train each the same way (epochs, lr, seq len, draft vocabulary, held-out samples; speculators' default seed): hybrid
and online while the service runs (training asks it for the states not stored), offline after it is stopped (it
needs none). Per mode: the bucket bytes of its extract objects, the high-water mark of the trainer's cache directory +
the service's shared directory (sampled every --sample-s while the train task runs), the service's requests during
training (its /metrics vllm:request_success_total) and CPU seconds, the wall time of each epoch (the train task's live
progress: training loop started, each epoch's checkpoint stored). Then vLLM serves the target alone, and with each
exported drafter (eagle3, K), on --verify-prompts held-out prompts (the same samples in every mode), greedy
(learning_curve.verify_all, as `eyrie verify`). Writes --out (JSON, one entry per target), an SVG chart beside it and
the section of --results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_curve as lc  # noqa: E402
from results import svg_bars, write_section  # noqa: E402

from eyrie.core.config import load_settings  # noqa: E402
from eyrie.core.vllm import start_server, stop_server  # noqa: E402
from eyrie.data.manifest import Layout, load_run_manifest  # noqa: E402
from eyrie.data.store import open_store  # noqa: E402
from eyrie.stages import TRAIN  # noqa: E402
from eyrie.work import progress  # noqa: E402
from eyrie.work.extract_server import on_demand  # noqa: E402
from eyrie_extractor.vllm_backend import connector_env, extract_command  # noqa: E402
from eyrie_trainer.data import done_samples, heldout_ids  # noqa: E402
from eyrie_trainer.export import download  # noqa: E402
from eyrie_trainer.verify import Served, serve_flags  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODES = ("offline", "hybrid", "online")
SOURCE = "g"  # the generated run the three are cloned from
METRIC = "vllm:request_success_total"


@dataclass(frozen=True)
class Target:
    """A target and how it is run here: prompts (every `stride`-th row of `dataset`), vLLM flags, training."""
    model: str
    dataset: str
    stride: int
    prompts: int
    max_tokens: int
    layers: str
    max_model_len: int
    vllm_args: str
    sampling: tuple[str, ...]
    seq_len: int
    lr: float
    draft_vocab: int
    heldout: int


TARGETS = {
    # the tiny synthetic target (`make tiny-target`) on its own corpus, as examples/run.tiny.vllm.yaml
    "tiny": Target("assets/tiny-target", "tests/data/tiny_train_prompts.jsonl", 1, 96, 64, "2,4,5", 320,
                   "--enforce-eager", (), 256, 3e-3, 500, 8),
    # SmolLM2-135M-Instruct (`make smollm2`) on bench/run.smollm2-slice.yaml's rows (every 12th of the training mix)
    "smollm2": Target("assets/smollm2-135m-instruct", "assets/prompts/train-mix.jsonl", 12, 48, 96, "2,15,27", 512,
                      "--enforce-eager --dtype bfloat16", ("--temperature", "0.2", "--top-p", "0.9"), 1024, 3e-4,
                      8192, 8),
}


# --- pure parts (tests/test_benchmarks.py) -------------------------------------------------------

def prompt_slice(lines: list[str], count: int, stride: int) -> list[str]:
    """Every `stride`-th non-empty row from the first, the first `count` of them."""
    rows = [line for line in lines if line.strip()][::stride][:count]
    if len(rows) < count:
        raise SystemExit(f"the dataset has {len(rows)} rows at a stride of {stride}, fewer than {count} prompts")
    return rows


def epoch_walls(loop_started: float | None, checkpoints: dict[str, float], ended: float | None,
                epochs: int) -> dict:
    """Wall seconds of each epoch (loop start, then each epoch's checkpoint stored) and their mean (loop start to
    the evaluation phase, over the epochs)."""
    per, last = [], loop_started
    for label in sorted(checkpoints, key=int):
        if last is not None:
            per.append(checkpoints[label] - last)
        last = checkpoints[label]
    mean = (ended - loop_started) / epochs if loop_started is not None and ended is not None else None
    return {"per_epoch_s": per, "wall_per_epoch_s": mean}


def acceptance_error(length: float | None, per_position: list[float | None], drafts: int) -> float | None:
    """Standard error of vLLM's mean acceptance length (1 + accepted/drafts) over `drafts` drafts. A draft's accepted
    count a is the number of positions accepted in a row, so P(a >= m) is position m's acceptance rate p_m:
    E[a] = sum p_m, E[a^2] = sum (2m - 1) p_m (m from 1)."""
    if length is None or not drafts or any(p is None for p in per_position):
        return None
    mean, square = length - 1, sum((2 * m - 1) * p for m, p in enumerate(per_position, start=1))
    return math.sqrt(max(0.0, square - mean * mean) / drafts)


def same_within_noise(a: dict, b: dict) -> bool | None:
    """Two acceptance lengths differ by at most two standard errors of their difference (independent errors: the
    prompts are shared, so this errs on the side of calling them the same)."""
    if None in (a.get("length"), b.get("length"), a.get("error"), b.get("error")):
        return None
    return abs(a["length"] - b["length"]) <= 2 * math.hypot(a["error"], b["error"])


def expected_requests(samples: list[dict], heldout: set[str], epochs: int) -> int:
    """Requests training makes to the service: each on-demand training sample every epoch, each on-demand held-out
    sample once."""
    train = sum(1 for s in samples if on_demand(s) and s["sample_id"] not in heldout)
    held = sum(1 for s in samples if on_demand(s) and s["sample_id"] in heldout)
    return train * epochs + held


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def section(r: dict, svg: str | None = None) -> list[str]:
    """The RESULTS.md section from the JSON result (every target measured so far)."""
    targets = r["targets"]
    out = ["# Storage modes: offline, hybrid, online (bench/storage_modes.py)", ""]
    for name, t in targets.items():
        m = t["machine"]
        out += [f"- **{name}** ({t['model']}): {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB RAM"
                + (f", {m['gpu']}" if m["gpu"] else ", no GPU") + f"; {t['date']}; commit `{t['commit']}`; "
                f"vLLM {t['vllm']}. Command: `{t['command']}`",
                f"  - {t['prompts']} prompts answered once by the target in vLLM (at most {t['max_tokens']} tokens; "
                f"{t['generate_s']:.0f} s), {t['heldout']} held out; trained {t['epochs']} epochs, lr {t['lr']:g}, "
                f"seq len {t['seq_len']}, draft vocabulary {t['draft_vocab']}, K={t['k']}, on {t['device']}; vLLM "
                f"acceptance on {t['verify_prompts']} held-out prompts, greedy, at most {t['verify_tokens']} tokens."]
    out += ["", lc._row("target", "mode", "stored bytes (bucket)", "peak bytes (trainer cache + service dir)",
                        "of which hidden states", "service requests in training (expected)",
                        "wall / epoch (each epoch)", "vLLM acceptance (± s.e.)", "eyrie τ",
                        "greedy outputs identical with the drafter"), "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in targets.items():
        for mode, x in t["modes"].items():
            acc = x["acceptance"]
            out.append(lc._row(name, mode, _mb(x["stored_bytes"]), _mb(x["peak_bytes"]), _mb(x["peak_state_bytes"]),
                               f"{x['service_requests']} ({x['expected_requests']})",
                               lc._f(x["wall_per_epoch_s"], ".1f") + " s" + (
                                   f" ({', '.join(f'{w:.1f}' for w in x['per_epoch_s'])})" if x.get("per_epoch_s")
                                   else ""),
                               lc._f(acc["length"], ".3f") + (
                                   f" ± {acc['error']:.3f}" if acc["error"] is not None else ""),
                               lc._f(x["eyrie_tau"], ".3f"),
                               {True: "yes", False: "no"}.get(acc.get("identical_outputs"), "-")))
    out += ["", lc._row("target", "mode", "stored bytes", "peak bytes", "wall / epoch", "vLLM acceptance",
                        "same as offline within noise"), "|---|---|---|---|---|---|---|"]
    for name, t in targets.items():
        base = t["modes"]["offline"]
        for mode, x in t["modes"].items():
            if mode != "offline":
                same = same_within_noise(x["acceptance"], base["acceptance"])
                out.append(lc._row(name, f"{mode} / offline", _ratio(x["stored_bytes"], base["stored_bytes"]),
                                   _ratio(x["peak_bytes"], base["peak_bytes"]),
                                   _ratio(x["wall_per_epoch_s"], base["wall_per_epoch_s"]),
                                   _ratio(x["acceptance"]["length"], base["acceptance"]["length"]),
                                   "-" if same is None else ("yes" if same else "no")))
    out += ["", f"![acceptance, wall time per epoch and peak bytes per mode]({svg})"] if svg else []
    return out + ["", *reading(targets)]


def request_wait(mode: dict, offline: dict) -> float | None:
    """Seconds training waited per request to the service: its wall per epoch beyond offline's, over an epoch's
    requests (the held-out ones, fetched once, are counted in: a slight underestimate)."""
    wall, base, n = mode.get("wall_per_epoch_s"), offline.get("wall_per_epoch_s"), mode.get("service_requests")
    epochs = len(mode.get("per_epoch_s") or []) or None
    if None in (wall, base, epochs) or not n:
        return None
    return (wall - base) * epochs / n


def summary(entry: dict) -> dict:
    """An earlier run of a target, in brief: kept beside the newest (the machine is shared: runs differ)."""
    modes = entry["modes"]
    return {"command": entry["command"], "date": entry["date"], "commit": entry["commit"],
            **{key: {m: x.get(key) for m, x in modes.items()} for key in ("wall_per_epoch_s", "load_1m", "peak_bytes")},
            "acceptance": {m: x["acceptance"]["length"] for m, x in modes.items()}}


def earlier_lines(name: str, runs: list[dict]) -> list[str]:
    return [f"- earlier run of **{name}** (`{e['command']}`, {e['date']}, `{e['commit']}`): wall per epoch "
            + ", ".join(f"{m} {lc._f(w, '.1f')} s" for m, w in e["wall_per_epoch_s"].items())
            + "; load average " + ", ".join(f"{m} {lc._f(v, '.1f')}" for m, v in e["load_1m"].items())
            + "; vLLM acceptance " + ", ".join(f"{m} {lc._f(v, '.3f')}" for m, v in e["acceptance"].items()) + "."
            for e in runs]


def reading(targets: dict) -> list[str]:
    """What the numbers say, in words made from them."""
    return [line for name, t in targets.items() for line in (
        f"- **{name}**: " + "; ".join(target_reading(t["modes"])) + ".",
        *earlier_lines(name, t.get("earlier", [])))] + [
        line for note in NOTES for line in ("", note)]


def target_reading(modes: dict) -> list[str]:
    lengths = [x["acceptance"]["length"] for x in modes.values() if x["acceptance"]["length"] is not None]
    same = [same_within_noise(x["acceptance"], modes["offline"]["acceptance"]) for x in modes.values()]
    shas = {x["drafter_sha256"] for x in modes.values() if x.get("drafter_sha256")}
    loads = [f"{m} {x['load_1m']:.1f}" for m, x in modes.items() if x.get("load_1m") is not None]
    out = [f"vLLM acceptance {min(lengths, default=0):.3f}-{max(lengths, default=0):.3f} across the modes, "
           + ("every mode the same as offline within noise" if all(v is not False for v in same)
              else "a mode differs from offline beyond noise"),
           "wall per epoch " + ", ".join(f"{m} {lc._f(x['wall_per_epoch_s'], '.1f')} s" for m, x in modes.items()),
           f"the service answered {modes['hybrid']['service_requests']} (hybrid) and "
           f"{modes['online']['service_requests']} (online) requests during training, "
           + ("as many as expected" if all(x["service_requests"] == x["expected_requests"] for x in modes.values())
              else "not the number expected") + "; offline trained with it stopped"]
    if loads:
        out.append(f"the machine's 1-minute load average while each trained (2 cores, shared): {', '.join(loads)}")
    waits = {m: request_wait(modes[m], modes["offline"]) for m in ("hybrid", "online")}
    if all(w is not None for w in waits.values()):
        out.append("training waited about " + " and ".join(f"{w:.2f} s ({m})" for m, w in waits.items())
                   + " per request to the service (wall per epoch beyond offline's, over the requests of an epoch): "
                   "the CPU trainer loads samples in its own process (0 loader workers), so it waits for each request")
    if None not in (h := modes["hybrid"]["wall_per_epoch_s"], o := modes["online"]["wall_per_epoch_s"]) and h > o:
        out.append("hybrid's epochs took longer than online's with half the requests: most likely other jobs on the "
                   "shared cores (see the load average and the earlier run), not the mode")
    out += ["the three exported drafters are bit-identical (one sha256)" if len(shas) == 1 else
            f"the exported drafters differ in their bytes ({len(shas)} sha256s)"] if shas else []
    if max(lengths, default=0) < 1.2:
        out.append("drafters trained this briefly accept about one token per step (acceptance ~1.0): the modes are "
                   "compared on drafters that have learnt almost nothing, so agreement here shows the states reach "
                   "training intact, not that a useful drafter comes out the same")
    return out


NOTES = [
    "\"Same within noise\": the difference from offline is at most two standard errors of the difference (each "
    "error from vLLM's own counters: the spread of accepted tokens per draft over the drafts made, computed from the "
    "per-position acceptance rates; the modes' errors treated as independent although the prompts are shared). "
    "The three runs train on the same samples in the same order with speculators' default seed; the states come "
    "from the same vLLM extraction service, stored at extraction or made again during training (in other batches, "
    "so not necessarily to the last bit): the drafters' sha256s say whether the bytes matched.",
    "Peak bytes: the highest sum, sampled every 0.2 s while the train task ran, of the trainer's cache directory "
    "(the materialized training and held-out data, checkpoints, logs) and the service's shared directory (states "
    "written for a request, deleted once read); \"of which hidden states\" counts the data directory and the shared "
    "directory alone. Wall / epoch: the train task's training loop start to its evaluation phase, over the epochs "
    "(data preparation, evaluation and export not in it); the machine was shared with other test runs, so the load "
    "average above says how much of it was ours.",
]


def chart(r: dict) -> str:
    """Bars per mode, grouped by target: vLLM acceptance, wall seconds per epoch, peak MB."""
    pick = lambda f: {name: {m: f(x) for m, x in t["modes"].items()} for name, t in r["targets"].items()}  # noqa: E731
    return svg_bars({"vLLM acceptance length": pick(lambda x: x["acceptance"]["length"]),
                     "wall s / epoch": pick(lambda x: x["wall_per_epoch_s"]),
                     "peak MB (cache + service dir)": pick(
                         lambda x: x["peak_bytes"] / 1e6 if x["peak_bytes"] is not None else None),
                     "stored MB (bucket)": pick(lambda x: x["stored_bytes"] / 1e6)},
                    "Storage modes: offline, hybrid, online (vLLM CPU build as the extraction service)", lc.COLORS)


# --- processes -----------------------------------------------------------------------------------

def model_path(t: Target) -> str:
    """The target as every process names it (the extraction service, generation and vLLM's model name)."""
    return str(ROOT / t.model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout_s:g} s")


@contextlib.contextmanager
def redis_server(work: Path):
    """A Redis of its own on a free port, no persistence."""
    port, folder = free_port(), work / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL)
    try:
        time.sleep(1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(30)


def eyrie(*args: str, timeout: float = 3600) -> float:
    """The real `eyrie` command line; its wall seconds."""
    started = time.monotonic()
    done = subprocess.run([str(BIN / "eyrie"), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"eyrie {shlex.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return time.monotonic() - started


class Service:
    """vLLM's extraction service (CPU-safe connector), started as tests/test_storage_modes.py starts it."""

    def __init__(self, t: Target, settings, work: Path):
        self.port, self.shared, self.log = free_port(), work / "hs-shared", work / "extract-service.log"
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--max-model-len", str(t.max_model_len), *shlex.split(t.vllm_args)]
        cmd = extract_command(model_path(t), [int(x) for x in t.layers.split(",")], self.shared, 1, self.port, flags,
                              vllm_command=settings.vllm_command, cpu=True)
        self.proc = start_server(cmd, env=connector_env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        wait_http(f"{self.url}/v1/models", self.proc, self.log)

    def requests_served(self) -> int:
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(METRIC + "{")))

    def cpu_s(self) -> float:
        """CPU seconds of its whole process tree so far."""
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                total += c.user + c.system
        return total

    def stop(self) -> None:
        stop_server(self.proc, grace_s=60)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (files vanishing meanwhile count 0)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


class Monitor(threading.Thread):
    """While a train task runs: the high-water mark of its cache + the service's directory, every `every_s`, and when
    its live progress shows the training loop start, each checkpoint stored and the evaluation phase."""

    def __init__(self, conn, run: str, cache: Path, shared: Path | None, every_s: float):
        super().__init__(daemon=True)
        self.conn, self.run_name, self.cache, self.shared, self.every_s = conn, run, cache, shared, every_s
        self.stop, self.peak, self.peak_states, self.samples, self.load = threading.Event(), 0, 0, 0, 0.0
        self.loop_started = self.ended = None
        self.checkpoints: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every_s)
        self.sample()

    def sample(self) -> None:
        shared = tree_bytes(self.shared) if self.shared else 0
        data = tree_bytes(self.cache / "runs" / self.run_name / "data")
        self.peak, self.samples = max(self.peak, tree_bytes(self.cache) + shared), self.samples + 1
        self.peak_states = max(self.peak_states, data + shared)
        self.load += os.getloadavg()[0]  # other jobs on the machine show here
        now = time.time()
        for live in progress.read(self.conn, self.run_name, "train").values():
            if self.loop_started is None and "steps_per_epoch" in live:
                self.loop_started = now
            for c in live.get("checkpoints", []):
                self.checkpoints.setdefault(c["label"], now)
            if self.ended is None and live.get("phase") in ("evaluating", "done"):
                self.ended = now


def train(run: str, a, t: Target, work: Path, conn, service: Service | None) -> dict:
    """`eyrie train` + one `eyrie worker train --burst` with a cache of its own, measured."""
    cache = work / f"cache-{run}"
    shutil.rmtree(cache, ignore_errors=True)
    eyrie("train", "--run", run, "--epochs", str(a.epochs), "--seq-len", str(t.seq_len), "--lr", str(t.lr),
          "--draft-vocab", str(t.draft_vocab), "--heldout", str(t.heldout), "--ttt-steps", str(a.k))
    requests_before, cpu_before = (service.requests_served(), service.cpu_s()) if service else (0, 0.0)
    monitor = Monitor(conn, run, cache, service.shared if service else None, a.sample_s)
    monitor.start()
    os.environ["EYRIE_CACHE_DIR"] = str(cache)  # the worker's
    try:
        task_s = train_worker(conn, run, work / f"worker-{run}.log")
    finally:
        os.environ["EYRIE_CACHE_DIR"] = str(work / "cache")
        monitor.stop.set()
        monitor.join()
    status = json.loads(subprocess.run([str(BIN / "eyrie"), "status", run, "--json"], capture_output=True,
                                       text=True).stdout)["stages"]["train"]
    if status.get("state") != "done":
        raise SystemExit(f"run {run}: training did not finish: {status}")
    return {"task_s": task_s, "peak_bytes": monitor.peak, "peak_state_bytes": monitor.peak_states,
            "disk_samples": monitor.samples, "load_1m": monitor.load / max(1, monitor.samples),
            "service_running": service is not None,
            "service_requests": service.requests_served() - requests_before if service else 0,
            "service_cpu_s": service.cpu_s() - cpu_before if service else 0.0, "notes": status.get("notes", []),
            **epoch_walls(monitor.loop_started, monitor.checkpoints, monitor.ended, a.epochs)}


def train_worker(conn, run: str, log: Path, grace_s: float = 15) -> float:
    """`eyrie worker train --burst` until its task has ended; the task's seconds (RQ's start to end). A burst worker
    whose RQ scheduler was forked after speculators trained in the process inherits speculators' SIGTERM handler
    and never exits (the scheduler ignores the worker's SIGTERM): once the task has ended and `grace_s` passed, the
    worker's process group is killed."""
    proc = subprocess.Popen([str(BIN / "eyrie"), "worker", "train", "--burst"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    job, ended_at = f"rq:job:{TRAIN.task_id(run, 0)}", None
    while proc.poll() is None:
        if ended_at is None and conn.hget(job, "status") in (b"finished", b"failed", b"stopped", b"canceled"):
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > grace_s:
            print(f"worker train ({run}): its task ended {grace_s:g} s ago and it has not exited: killed", flush=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(0.5)
    fields = {k.decode(): v.decode() for k, v in conn.hgetall(job).items()
              if k in (b"status", b"started_at", b"ended_at")}
    if fields.get("status") != "finished":
        raise SystemExit(f"run {run}: the train task ended {fields}: {log.read_text(errors='replace')[-3000:]}")
    when = lambda key: dt.datetime.fromisoformat(fields[key].replace("Z", "+00:00"))  # noqa: E731
    return (when("ended_at") - when("started_at")).total_seconds()


def generate(a, t: Target, settings, store, work: Path) -> float:
    """The prompts answered by the target in vLLM (run `g`, two shards), cloned into one run per mode."""
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(prompt_slice((ROOT / t.dataset).read_text().splitlines(keepends=True),
                                            a.prompts, t.stride)))
    started = time.monotonic()
    with Served(settings, model_path(t), serve_flags(settings, None), work / "generate-vllm.log") as server:
        os.environ["EYRIE_INFERENCE_URL"] = server.url
        eyrie("generate", "--dataset", str(prompts), "--run", SOURCE, "--concurrency", "16", "--max-tokens",
              str(a.max_tokens), "--shard-size", str(math.ceil(a.prompts / 2)), *t.sampling)
        eyrie("worker", "generate", "--burst")
    source, shards = Layout(SOURCE), load_run_manifest(store, SOURCE).generate_shards
    counts = [store.get_json(source.generate_shard_manifest(s.index)) for s in shards]
    if sum(c["counts"]["done"] for c in counts) < a.prompts:
        raise SystemExit(f"generation answered fewer than {a.prompts}: "
                         f"{[(c['counts'], c['failure_errors']) for c in counts]}")
    for run in MODES:
        store.put_json(Layout(run).manifest, {**store.get_json(source.manifest), "run": run})
        for shard in shards:
            store.put_json(Layout(run).generate_shard_manifest(shard.index),
                           {**store.get_json(source.generate_shard_manifest(shard.index)), "run": run})
    return time.monotonic() - started


def extract(store, run: str, t: Target, service: Service, *storage: str) -> dict:
    before = service.requests_served()
    wall = eyrie("extract", "--run", run, "--backend", "vllm", "--layers", t.layers, "--max-length",
                 str(t.max_model_len - 1), *storage)
    wall += eyrie("worker", "extract", "--burst")
    if not done_samples(store, run):
        raise SystemExit(f"run {run}: extraction stored no sample (read {service.log})")
    return {"extract_s": wall, "extract_requests": service.requests_served() - before}


def stored(store, run: str, heldout: int, epochs: int) -> dict:
    samples = done_samples(store, run)
    held = heldout_ids(samples, heldout)
    return {"stored_bytes": sum(s["bytes"] for s in samples), "samples": len(samples),
            "samples_with_states": sum(1 for s in samples if not on_demand(s)),
            "tokens": sum(s["seq_len"] for s in samples), "expected_requests": expected_requests(samples, held, epochs)}


def acceptance(store, settings, a, t: Target, work: Path) -> tuple[dict, dict]:
    """vLLM: the target alone, then each mode's exported drafter, on the held-out prompts."""
    drafters = {}
    for run in MODES:
        download(store, run, folder := work / "drafters" / run)
        drafters[run] = folder
    ns = SimpleNamespace(run="offline", prompts=a.verify_prompts, bench="", max_tokens=a.verify_tokens, k=a.k)
    _, alone, verified = lc.verify_all(settings, store, ns, load_run_manifest(store, "offline"), drafters,
                                       work / "verify")
    out = {}
    for run, v in verified.items():
        h = v["sets"][lc.HELDOUT]
        out[run] = {"length": h["vllm_acceptance_length"], "drafts": h["vllm_drafts"],
                    "per_position": h["vllm_per_position_acceptance"], "identical_outputs": h["identical_outputs"],
                    "speedup_1": h["speedup"]["1"], "verify_s": v["verify_s"],
                    "error": acceptance_error(h["vllm_acceptance_length"], h["vllm_per_position_acceptance"],
                                              h["vllm_drafts"])}
    return out, alone[lc.HELDOUT]


def measure(a, t: Target, work: Path) -> dict:
    settings = load_settings()
    store, result = open_store(settings), {"modes": {run: {} for run in MODES}}
    result["generate_s"] = generate(a, t, settings, store, work)
    service = Service(t, settings, work)
    try:
        os.environ["EYRIE_EXTRACT_VLLM_URL"] = service.url
        modes = result["modes"]
        modes["offline"] |= extract(store, "offline", t, service, "--storage", "offline")
        budget = stored(store, "offline", t.heldout, a.epochs)["stored_bytes"] // 2
        modes["hybrid"] |= extract(store, "hybrid", t, service, "--storage", "hybrid", "--budget", f"{budget}B")
        modes["online"] |= extract(store, "online", t, service, "--storage", "online")
        conn = __import__("redis").Redis.from_url(settings.redis_url)
        for run in ("hybrid", "online"):
            print(f"training {run} (the service running)", flush=True)
            modes[run] |= train(run, a, t, work, conn, service)
    finally:
        service.stop()
    print("training offline (the service stopped)", flush=True)
    modes["offline"] |= train("offline", a, t, work, conn, None)
    for run in MODES:
        drafter = store.get_json(Layout(run).drafter_manifest)
        modes[run] |= stored(store, run, t.heldout, a.epochs) | {
            "eyrie_tau": drafter.get("tau"), "drafter_sha256": drafter["files"]["model.safetensors"]["sha256"]}
    modes["hybrid"]["budget_bytes"] = budget
    print("vLLM acceptance of each drafter", flush=True)
    figures, result["target_tokens_per_s"] = acceptance(store, settings, a, t, work)
    for run in MODES:
        modes[run]["acceptance"] = figures[run]
    result["modes"] = {run: modes[run] for run in MODES}
    return result


def vllm_version(settings) -> str:
    done = subprocess.run([settings.vllm_command, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "?"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=list(TARGETS), help="required unless --render")
    p.add_argument("--prompts", type=int, help="prompts answered (default: the target's)")
    p.add_argument("--max-tokens", type=int, help="answer length when generating (default: the target's)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="draft length trained and served")
    p.add_argument("--verify-prompts", type=int, default=8, help="held-out prompts vLLM answers")
    p.add_argument("--verify-tokens", type=int, default=64, help="answer length in vLLM's acceptance pass")
    p.add_argument("--sample-s", type=float, default=0.2, help="how often the disk is sampled while training")
    p.add_argument("--work", type=Path, default=ROOT / ".eyrie" / "bench" / "storage-modes")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "storage_modes.json")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--render", action="store_true", help="only the chart and the section again, from --out")
    a = p.parse_args(argv)
    if not a.target and not a.render:
        p.error("--target is required (unless --render)")
    if a.target:
        t = TARGETS[a.target]
        a.prompts, a.max_tokens = a.prompts or t.prompts, a.max_tokens or t.max_tokens
    a.command = "python bench/storage_modes.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.render:
        return render(a, json.loads(a.out.read_text()))
    t, work = TARGETS[a.target], a.work / a.target
    if not (ROOT / t.model / "config.json").exists():
        raise SystemExit(f"{t.model} is missing: `make {'tiny-target' if a.target == 'tiny' else 'smollm2'}`")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.chdir(ROOT)
    with redis_server(work) as redis_url:
        os.environ.update({"EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"file://{work / 'store'}",
                           "EYRIE_CACHE_DIR": str(work / "cache"), "EYRIE_DEVICE": "cpu", "EYRIE_MODEL": model_path(t),
                           "EYRIE_VLLM_COMMAND": os.environ.get("EYRIE_VLLM_COMMAND",
                                                                str(ROOT / ".venv-vllm" / "bin" / "python")),
                           "EYRIE_MAX_MODEL_LEN": str(t.max_model_len), "EYRIE_VLLM_ARGS": t.vllm_args,
                           "EYRIE_SERVE_DEADLINE_S": "900", "VLLM_CPU_KVCACHE_SPACE": "1",
                           "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"})
        started = time.monotonic()
        measured = measure(a, t, work)
    settings = load_settings()
    result = {"target": a.target, "model": t.model, "command": a.command, **lc.machine(), "device": "cpu",
              "vllm": vllm_version(settings), "settings": asdict(t), "prompts": a.prompts, "max_tokens": a.max_tokens,
              "heldout": t.heldout, "epochs": a.epochs, "k": a.k, "lr": t.lr, "seq_len": t.seq_len,
              "draft_vocab": t.draft_vocab, "verify_prompts": a.verify_prompts, "verify_tokens": a.verify_tokens,
              "total_s": time.monotonic() - started, **measured}
    everything = json.loads(a.out.read_text()) if a.out.exists() else {"targets": {}}
    if previous := everything["targets"].get(a.target):
        result["earlier"] = previous.get("earlier", []) + [summary(previous)]
    everything["targets"][a.target] = result
    render(a, everything)


def render(a, everything: dict) -> None:
    """The JSON, the chart beside it and the RESULTS.md section."""
    everything["targets"] = {n: everything["targets"][n] for n in TARGETS if n in everything["targets"]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(everything, indent=2, default=str))
    svg = a.out.with_suffix(".svg")
    svg.write_text(chart(everything))
    write_section(a.results, section(everything, os.path.relpath(svg, a.results.parent)))
    print("\n".join(section(everything)))


if __name__ == "__main__":
    main()
