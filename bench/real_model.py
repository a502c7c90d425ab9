"""A real-model run that outlasts a sitting: the pipeline, then the learning curve, continued where they stopped.

  .venv/bin/python bench/real_model.py --config examples/run.smollm2.yaml --sizes 250,500,1k,2k     (--help)
Everything lives under one directory outside the work tree, --home (default: $EYRIE_HOME, else ~/.cache/eyrie):
its Redis (AOF on; started here when none answers there, stopped at the end), the file store, the cache (training
data, checkpoints, the learning curve's slices), vLLM's hidden-states exchange and the logs. Rerunning the same
command continues: it prints what it reused (generate and extract shards done, the newest training checkpoint,
export, verify, the learning curve's slices), starts only the services still needed (`eyrie serve` while
generation is unfinished, `eyrie serve-extract --once` while extraction is, one worker per queue), continues the
pipeline (`eyrie run --config C --wait`: a rerun continues, nothing done is redone), then
bench/learning_curve.py on the run (each slice's point, checkpoints and vLLM figures kept between sittings).
Ctrl-C or SIGTERM stops it all: the workers hand their tasks back, the trainer saves a resumable checkpoint.
"""

from __future__ import annotations

import argparse, os, signal, subprocess, sys
from contextlib import contextmanager
from pathlib import Path

import redis
import yaml

from eyrie.commands.embedded import HeldInterrupt, stop as stop_process
from tests.support.processes import start_redis

ROOT = Path(__file__).resolve().parent.parent
REDIS_START_S = 30
INTERRUPT = HeldInterrupt()  # SIGTERM as Ctrl-C, held while a child starts (eyrie demo's)


def home_dir(given: Path | None) -> Path:
    return (given or Path(os.environ.get("EYRIE_HOME") or Path.home() / ".cache" / "eyrie")).expanduser().resolve()


def home_env(home: Path, redis_url: str) -> dict:
    """The eyrie settings that put every byte of a run under `home` (none in the work tree)."""
    return {"EYRIE_REDIS_URL": redis_url, "EYRIE_STORE_URL": f"file://{home / 'store'}",
            "EYRIE_CACHE_DIR": str(home / "cache"), "EYRIE_EXTRACT_SHARED_DIR": str(home / "hs-shared")}


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@contextmanager
def own_redis(home: Path):
    """The Redis of `home` (home/redis: its AOF, its port file): the one answering there, else one started here
    (AOF on) and shut down on the way out. Yields (url, started)."""
    folder = home / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / "port"
    if port_file.exists() and _answers(url := f"redis://127.0.0.1:{port_file.read_text().strip()}/0"):
        yield url, False
        return
    try:
        proc, url = start_redis(folder, aof=True, log=folder / "redis.log", new_session=True, timeout=REDIS_START_S)
    except RuntimeError as exc:
        raise SystemExit(f"{exc}.") from None
    port_file.write_text(str(redis.Redis.from_url(url).connection_pool.connection_kwargs["port"]))
    try:
        yield url, True
    finally:
        try:
            redis.Redis.from_url(url).shutdown()  # the AOF is fsynced before it exits
        except redis.ConnectionError:
            pass  # shutdown closes the connection as it exits
        proc.wait(REDIS_START_S)
        port_file.unlink(missing_ok=True)


def progress(store, run: str) -> dict | None:
    """What a run has done, read from its store keys alone: None before it was planned."""
    root = f"runs/{run}"
    if not store.exists(f"{root}/manifest.json"):
        return None
    manifest = store.get_json(f"{root}/manifest.json")
    shards = len(manifest.get("generate_shards") or [])
    done = lambda stage: sum(1 for k in store.list(f"{root}/{stage}/shards/") if k.endswith(".manifest.json"))
    checkpoints = [store.get_json(k) for k in store.list(f"{root}/train/checkpoints/") if k.endswith(".manifest.json")
                   and k.count("/") == root.count("/") + 3]  # runs/R/train/checkpoints/LABEL.manifest.json
    newest = max(checkpoints, key=lambda c: (c["epoch"], c["local_step"]), default=None)
    return {"shards": shards, "generate": done("generate"), "extract": done("extract") if manifest.get("extract") else 0,
            "checkpoint": newest and {"epoch": newest["epoch"], "local_step": newest["local_step"]},
            "exported": store.exists(f"{root}/train/drafter.manifest.json"), "verify": manifest.get("verify"),
            "states_from": manifest.get("states_from")}


def reused_line(p: dict | None) -> str:
    """What a sitting finds done, as one line."""
    if p is None:
        return "reused: nothing (a new run)"
    if p["states_from"]:
        parts = [f"generated answers and hidden states of run {p['states_from']}"]
    else:
        parts = [f"{p['generate']} of {p['shards']} generate shards done",
                 "extract done" if p["shards"] and p["extract"] == p["shards"]
                 else f"{p['extract']} of {p['shards']} extract shards done"]
    c = p["checkpoint"]
    parts.append("no train checkpoint" if c is None else f"train checkpoint epoch {c['epoch']}"
                 + (f" step {c['local_step']}" if c["local_step"] else ""))
    parts += ["exported"] * p["exported"]
    if p["verify"]:
        parts.append("verify skipped" if p["verify"].get("skipped") else "verified")
    return "reused: " + ", ".join(parts)


def services_needed(p: dict | None, backend: str, server_queues: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(log name, eyrie arguments) of what this sitting starts: the target's server while generation is
    unfinished, vLLM's extraction service while extraction is (vLLM backend), one worker per queue."""
    generated = p is not None and (p["states_from"] or (p["shards"] and p["generate"] == p["shards"]))
    extracted = p is not None and (p["states_from"] or (p["shards"] and p["extract"] == p["shards"]))
    out = [] if generated else [("inference", ["serve", "--config", "{config}"])]
    out += [] if extracted or backend != "vllm" else [("serve-extract", ["serve-extract", "--once"])]
    return out + [(name, ["worker", queue]) for queue, name in server_queues.items()]


def start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "eyrie.commands.cli", *args], cwd=ROOT, env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """The demo's stop (SIGTERM, SIGKILL after `timeout`), with time for a worker to hand its task
    back and the trainer to save a checkpoint."""
    stop_process(proc, timeout)


def continue_pipeline(config: Path, env: dict, logs: Path, p: dict | None) -> int:
    """`eyrie run --config C --wait` with the services it still needs; their exit stops them all."""
    from eyrie.core.vllm import available
    from eyrie.core.config import load_settings
    from eyrie.stages import PIPELINE

    cfg = yaml.safe_load(config.read_text())
    settings = load_settings()
    queues = {s.queue: s.worker for s in PIPELINE if not s.needs_vllm or available(settings.vllm_command)}
    procs = []
    try:
        for name, args in services_needed(p, (cfg.get("extract") or {}).get("backend", "hf"), queues):
            print(f"starting {name}: eyrie {' '.join(args).format(config=config)} (log {logs / name}.log)", flush=True)
            with INTERRUPT.held():
                procs.append(start([a.format(config=config) for a in args], env, logs / f"{name}.log"))
        return subprocess.run([sys.executable, "-m", "eyrie.commands.cli", "run", "--config", str(config), "--wait"],
                              cwd=ROOT, env=env).returncode
    finally:
        for proc in reversed(procs):
            stop(proc)


def print_verified(store, run: str) -> None:
    """The pipeline's verify figures as `eyrie verify` prints them: a line per set and K (MT-Bench per turn too)."""
    from eyrie.commands.display import verify_lines

    verified = (progress(store, run) or {}).get("verify")
    if verified and not verified.get("skipped"):
        print("\n".join(verify_lines(run, verified)), flush=True)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "run.smollm2.yaml", help="the run config")
    p.add_argument("--home", type=Path, help="Redis, store, cache, logs (default: $EYRIE_HOME, else ~/.cache/eyrie)")
    p.add_argument("--server", default="vllm", help="EYRIE_SERVER for the target (the real model: vllm)")
    p.add_argument("--sizes", default="", help="learning-curve slices, e.g. 250,500,1k,2k (empty: no curve)")
    p.add_argument("--curve-args", default="", help="further bench/learning_curve.py options, e.g. '--prompts 80'")
    p.add_argument("--results", type=Path, help="the RESULTS.md the curve's section goes into (default: HOME/results/RESULTS.md; "
                                                "bench/RESULTS.md to record it in the repository)")
    p.add_argument("--save-answers", type=Path, metavar="ARCHIVE", help="save the run's generated answers (its plan "
                   "and generate objects, finished or not) to ARCHIVE (.tar.xz) and exit (bench/answers_carry.py)")
    p.add_argument("--restore-answers", type=Path, metavar="ARCHIVE", help="before continuing, restore answers a "
                   "sitting saved, where the store does not have the run yet")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    home, config = home_dir(a.home), a.config.resolve()
    os.chdir(ROOT)  # the config's relative paths (target, dataset) are the repository's; nothing is written here
    run = yaml.safe_load(config.read_text())["run"]
    with own_redis(home) as (url, started):
        env = {**os.environ, **home_env(home, url), "EYRIE_SERVER": a.server, "HF_HUB_OFFLINE": "1"}
        os.environ.update(env)  # this process's own reads (the store, the learning curve)
        from eyrie.core.config import load_settings
        from eyrie.data.store import open_store
        from answers_carry import restore_answers, save_answers

        store = open_store(load_settings())
        print(f"home {home}: Redis {url} ({'started here' if started else 'already running'}), store {store.url}")
        if a.save_answers:
            print(f"saved {save_answers(store, run, a.save_answers)} objects of run {run} to {a.save_answers}")
            return 0
        if a.restore_answers:
            restored = restore_answers(store, run, a.restore_answers)
            print(f"restored {restored} objects of run {run} from {a.restore_answers}" if restored
                  else f"run {run} is in the store already: {a.restore_answers} not restored")
        before = progress(store, run)
        print(reused_line(before), flush=True)
        code = 0 if before and before["verify"] else continue_pipeline(config, env, home / "logs", before)
        print_verified(store, run)
        if code or not a.sizes:
            return code
        import learning_curve

        return learning_curve.main(["--run", run, "--sizes", a.sizes, "--out", str(home / "results" / f"{run}.json"),
                                    "--results", str(a.results or home / "results" / "RESULTS.md"),
                                    *a.curve_args.split()]) or 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, INTERRUPT)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("stopped (services, workers and Redis stopped; the trainer saved a checkpoint): rerun the same "
              "command to continue", file=sys.stderr)
        sys.exit(130)
