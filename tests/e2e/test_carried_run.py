"""README's restore command, run as a user elsewhere runs it (issue 49): from a second copy of the
repository at another path, `bench/real_model.py --config C --restore-answers ARCHIVE` continues the
archived run at extraction (the command is stopped once `eyrie run` says "extract started": the
extraction itself is other tests'). Once with a small archive made here, of a tiny-target run planned
in this checkout (its generate shards' manifests written as their tasks leave them: no server), and
once with the committed general run's archive on SmolLM2 (`make smollm2`'s target, in the copy)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from bench.answers_carry import save_answers
from eyrie.core.config import load_settings
from eyrie.data.store import open_store
from eyrie.runs.control import start_and_plan
from eyrie.stages.run_config import load_config
from tests.integration.test_run_identity import generated
from tests.support.harness import OFFLINE, ROOT, SMOLLM2, TINY, TRAIN_PROMPTS, rel

SERVICES = ("generator", "inference", "extractor", "trainer")
STARTED = "extract started"


def second_copy(where: Path) -> Path:
    """The repository's files (tracked and not ignored, as a clone of this work tree has them) at another path."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    return where


def restore_and_continue(copy: Path, config: str, archive: Path, home: Path, timeout: float = 600) -> str:
    """README's command in `copy` (its own code first on the path), stopped once extraction has started;
    returns what it printed."""
    path = os.pathsep.join([str(copy), *(str(copy / "services" / s) for s in SERVICES)])
    env = {**os.environ, **OFFLINE, "PYTHONPATH": path, "EYRIE_VLLM_COMMAND": str(copy / "no-vllm-here")}
    env.pop("EYRIE_MODEL", None)
    log = home / "real_model.log"
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "bench/real_model.py", "--config", config, "--restore-answers",
                             str(archive), "--home", str(home)], cwd=copy, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while STARTED not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # real_model.py stops its services and Redis on SIGTERM
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in running_in(copy):  # a service still stopping (each in a session of its own) goes with the copy
            os.kill(pid, signal.SIGKILL)
    return log.read_text()


def running_in(folder: Path) -> list[int]:
    """The processes whose working directory is `folder` (real_model.py starts its services there)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder.resolve():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_small_archive_continues_at_extraction_from_a_copy_elsewhere(env, tmp_path):
    body = {"run": "carried", "target": {"model": rel(TINY)}, "dataset": {"source": rel(TRAIN_PROMPTS), "limit": 8},
            "generate": {"max_tokens": 64, "shard_size": 4}, "extract": {"layers": [2, 4, 5]},
            "train": {"epochs": 1, "seq_len": 256, "draft_vocab": 500}, "verify": {"enabled": False}}
    (tmp_path / "carried.yaml").write_text(yaml.safe_dump(body))
    cwd = Path.cwd()
    os.chdir(ROOT)  # the config's relative paths are the repository's (as real_model.py reads them)
    try:
        cfg = load_config(tmp_path / "carried.yaml")
    finally:
        os.chdir(cwd)
    settings = load_settings(model=cfg.target.model)
    conn, store = redis.Redis.from_url(env["EYRIE_REDIS_URL"]), open_store(settings)
    start_and_plan(settings, conn, store, cfg)
    generated(store, "carried")
    archive = tmp_path / "carried.tar.xz"
    save_answers(store, "carried", archive)
    assert str(ROOT) not in subprocess.run(["tar", "-xJOf", str(archive)], capture_output=True, text=True).stdout

    copy = second_copy(tmp_path / "elsewhere")
    shutil.copy(tmp_path / "carried.yaml", copy / "carried.yaml")
    out = restore_and_continue(copy, "carried.yaml", archive, tmp_path / "home")
    assert "restored" in out and STARTED in out, out[-3000:]
    assert "started with another config" not in out


def test_the_committed_general_archive_continues_at_extraction_from_a_copy_elsewhere(smollm2_target, tmp_path):
    """README's own command, bench/answers/smollm2-general-2k.tar.xz (2,200 rows, 2,326 answers)."""
    copy = second_copy(tmp_path / "elsewhere")
    shutil.copytree(smollm2_target, copy / rel(SMOLLM2))  # what `make smollm2` writes there
    out = restore_and_continue(copy, "bench/run.smollm2-general.yaml", Path("bench/answers/smollm2-general-2k.tar.xz"),
                               tmp_path / "home")
    assert "restored" in out and STARTED in out, out[-3000:]
