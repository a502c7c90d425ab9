"""How long the stack's vLLM extraction server (`eyrie serve-extract`) lives (issue 23): an offline
run needs it until every shard is extracted; a hybrid or online run until its drafter is trained,
since the trainer asks it for the hidden states not stored (an online run's extract stage needs
none, its training does). Cancelled or no longer active: it stops. For such a run it shares its GPUs
with the trainer: a "share" lease, vLLM at the plan's utilization. Real Redis and a real file store;
the lifetime end to end through tests/fake_vllm (as in tests/e2e/test_extract_server.py)."""

import os
import subprocess
import time

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, config_key, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.projection import project
from eyrie.tasks.executor import Context, RunTask, StageTask, execute
from eyrie.work import inference, keys
from eyrie.work.gpu import holder, leases
from eyrie_inference import extract_server
from eyrie_inference.extract_server import ExtractServer, extraction_run
from eyrie_trainer.runner import TrainRunner
from tests.e2e.test_extract_server import RUN, _config, _manifest, extract_server_ready
from tests.support.harness import BIN, ROOT
from tests.support.processes import free_port, stop

OFFLINE_RUN = "a-offline"  # sorted before RUN: extraction_run passes over it


def _settings(redis_url: str, tmp_path):
    return load_settings(store_url=f"file://{tmp_path / 'store'}", redis_url=redis_url,
                         extract_shared_dir=str(tmp_path / "hs"))


def _plant(conn, store, run: str, storage: str, shards=(0, 1)) -> None:
    """An active run on the vLLM backend whose extract stage stores `storage`, `shards` extracted."""
    manifest = _manifest()
    params = manifest.extract.model_copy(update={"storage": storage})
    manifest = manifest.model_copy(update={"run": run, "extract": params})
    store.put_json(config_key(run), _config().model_copy(update={"run": run}).model_dump())
    store.put_json(Layout(run).manifest, manifest.model_dump())
    for shard in shards:
        store.put_json(Layout(run).extract_shard_manifest(shard), {})
    conn.sadd(keys.ACTIVE_PIPELINES, run)


def _trained(store, run: str) -> None:
    """What export writes first: the run manifest's drafter record, the train stage's proof that it is
    done (the drafter manifest beside it comes after; the server must not wait for that one)."""
    manifest = load_run_manifest(store, run)
    manifest.drafter = {"files": {}}
    store.put_json(Layout(run).manifest, manifest.model_dump())


@pytest.mark.parametrize("storage", ["hybrid", "online"])
def test_a_run_training_on_demand_is_served_after_extraction_until_its_drafter_is_trained(storage, redis_url,
                                                                                          tmp_path):
    conn, store = redis.Redis.from_url(redis_url), open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, OFFLINE_RUN, "offline")
    _plant(conn, store, RUN, storage)
    assert extraction_run(conn, store) == RUN  # extracted, still training: the offline one is done
    _trained(store, RUN)
    assert extraction_run(conn, store) is None


def test_the_server_of_a_run_training_on_demand_stops_once_trained_cancelled_or_inactive(redis_url, tmp_path):
    conn, store = redis.Redis.from_url(redis_url), open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, RUN, "hybrid")
    server = ExtractServer(_settings(redis_url, tmp_path), conn, store, RUN)
    assert not server._drained()  # every shard extracted, the trainer still asks it for states
    conn.srem(keys.ACTIVE_PIPELINES, RUN)
    assert server._drained()
    conn.sadd(keys.ACTIVE_PIPELINES, RUN)
    conn.set(keys.cancelled(RUN), "now")
    assert server._drained()
    conn.delete(keys.cancelled(RUN))
    assert not server._drained()
    _trained(store, RUN)
    assert server._drained()


def test_serve_extract_starts_for_an_extracted_online_run_and_stops_once_it_is_trained(redis_url, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EYRIE_REDIS_URL": redis_url,
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_EXTRACT_SHARED_DIR": str(tmp_path / "hs"),
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    store = open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, RUN, "online")
    log = tmp_path / "serve-extract.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve-extract", "--once", "--port", str(free_port())], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        extract_server_ready(conn, 60)
        assert "run xs trains on hidden states made on vLLM (extract.storage online)" in log.read_text()
        _wait_for_line(log, "serving until its drafter is trained", proc)
        assert proc.poll() is None and holder(conn)["holder"]["owner"].startswith("extract-server@")
        assert holder(conn)["holder"]["mode"] == "share"  # its trainer may hold one of its GPUs beside it
        assert "vLLM keeps its --gpu-memory-utilization: vLLM's CPU build sizes its KV cache" in log.read_text()
        _trained(store, RUN)
        assert proc.wait(60) == 0, log.read_text()
        assert holder(conn) is None and inference.read_extract(conn).state == "stopped"
        assert "run xs is trained: stopping vLLM and handing over the GPUs" in log.read_text()
    finally:
        stop(proc)


def test_a_run_training_on_demand_gets_a_sharing_lease_and_the_planned_utilization(redis_url, tmp_path,
                                                                                 monkeypatch, capsys):
    """On a GPU (on_cpu False): vLLM at the plan's utilization_for_both (storage_plan.gpu_sharing), in
    place of a higher one in serve.extra_args; a lower one stays. An offline run's server owns its GPUs."""
    conn, store = redis.Redis.from_url(redis_url), open_store(_settings(redis_url, tmp_path))
    _plant(conn, store, RUN, "hybrid")
    _plant(conn, store, OFFLINE_RUN, "offline")
    monkeypatch.setattr(extract_server, "on_cpu", lambda: False)

    def command(run: str, extra_args: list[str]) -> list[str]:
        config = _config().model_copy(update={"run": run})  # a GPU of 10 GB: the tiny target and its trainer
        config.plan.gpu_memory, config.serve.extra_args = "10GB", extra_args  # need 4.0 and 4.2 GB of it
        config.train.seq_len = 8192  # a GPU's pack (this host plans a CPU's 1,024 where none is given)
        store.put_json(config_key(run), config.model_dump())
        server = ExtractServer(_settings(redis_url, tmp_path), conn, store, run)
        planned = project(server.config, server.settings, measure=False).storage.gpu_sharing
        assert planned.utilization_for_both == 0.57 and server.gpu_mode() == ("own" if run == OFFLINE_RUN else
                                                                                 "share")
        return server.command()

    cmd = command(RUN, ["--gpu-memory-utilization", "0.9", "--enforce-eager"])
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.57"] and cmd.count("--gpu-memory-utilization") == 1
    assert "0.9" not in cmd and "--enforce-eager" in cmd
    out = capsys.readouterr().out
    assert ("eyrie serve-extract: run xs trains beside this server: --gpu-memory-utilization 0.57: the highest share "
            "at which the service (4.00 GB a GPU) fits and leaves the trainer (4.22 GB) room") in out
    assert command(RUN, ["--gpu-memory-utilization=0.5"])[-1] == "--gpu-memory-utilization=0.5"  # lower: kept
    assert "vLLM keeps its --gpu-memory-utilization: its 0.50 (serve.extra_args" in capsys.readouterr().out
    assert "--gpu-memory-utilization" not in command(OFFLINE_RUN, [])  # the GPUs are its own: vLLM's default
    monkeypatch.setattr(extract_server, "on_cpu", lambda: True)
    assert "--gpu-memory-utilization" not in command(RUN, [])
    assert "VLLM_CPU_KVCACHE_SPACE" in capsys.readouterr().out


def test_the_trainer_of_a_run_training_on_demand_leases_its_gpu_beside_the_server(redis_url, tmp_path):
    """TrainRunner.gpu_mode: "beside" for hybrid and online (read from the run manifest), else "own";
    the executor takes the stage's GPU lease in its task's mode."""
    conn, settings = redis.Redis.from_url(redis_url), _settings(redis_url, tmp_path)
    store = open_store(settings)
    ctx = Context(settings, conn, store)
    _plant(conn, store, RUN, "online")
    _plant(conn, store, OFFLINE_RUN, "offline")
    assert TrainRunner(ctx, RunTask(run=RUN)).gpu_mode() == "beside"
    assert TrainRunner(ctx, RunTask(run=OFFLINE_RUN)).gpu_mode() == "own"

    class Beside(StageTask):
        stage, gpu_owner = TrainRunner.stage, "trainer"

        def devices(self) -> str:
            return "cuda:0"

        def gpu_mode(self) -> str:
            return "beside"

        def run(self) -> dict:
            return self.result("done", mode=self.gpu.mode, holders=[h["mode"] for h in leases(conn)["holders"]])

    ctx = Context(settings.model_copy(update={"gpu_ids": "7", "gpu_host": "h1"}), conn, store)
    assert execute(Beside, {"run": RUN}, ctx) == {"status": "done", "mode": "beside", "holders": ["beside"]}


def _wait_for_line(log, text: str, proc, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.2)
