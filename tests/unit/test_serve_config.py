"""The run config says how its target is served (serve:), and a served model that is not the
run's target is refused before any request, naming both (issue 14)."""

import shutil

import pytest
import redis

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.stages.run_config import load_config
from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.core.target import describe
from eyrie.data.store import open_store
from eyrie.work import inference
from eyrie_generator.plan import plan_generate
from eyrie_inference.server import command
from tests.support.builders import publish_endpoint
from tests.support.harness import ROOT, TINY, TRAIN_PROMPTS, tiny_run_config


@pytest.fixture
def conn(redis_server):
    """Database 7 of the session's Redis: our published endpoints never reach other tests'."""
    url = redis_server.rsplit("/", 1)[0] + "/7"
    c = redis.Redis.from_url(url)
    c.flushdb()
    yield c
    c.flushdb()


def _start_generate(conn, tmp_path, model: str, run: str = "r1"):
    settings = load_settings(model=model, store_url=f"file://{tmp_path / 'store'}")
    return plan_generate(settings, conn, open_store(settings), run, DatasetSection(source=str(TRAIN_PROMPTS), limit=4),
                          GenerateSettings())


def test_the_run_keeps_its_own_target_when_the_server_published_a_relative_name(conn, tmp_path, monkeypatch):
    """The issue's repro: `eyrie serve` from the repo root published `assets/tiny-target`; the run
    names the absolute path from elsewhere. The run records its own target, not the served name."""
    monkeypatch.chdir(ROOT)
    publish_endpoint(conn, "assets/tiny-target", server="transformers", served_as="assets/tiny-target")
    monkeypatch.chdir(tmp_path)
    manifest, enqueued = _start_generate(conn, tmp_path, str(TINY))
    assert manifest.target.model == str(TINY) and enqueued == 1
    assert manifest.target.revision == describe(str(TINY)).revision


def test_a_served_model_that_is_not_the_target_is_refused_naming_both(conn, tmp_path):
    other = tmp_path / "other-target"
    shutil.copytree(TINY, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "eyrie_note": 1}', 1))
    publish_endpoint(conn, str(other), server="transformers")
    with pytest.raises(EyrieError) as err:
        _start_generate(conn, tmp_path, str(TINY))
    assert str(other) in str(err.value) and str(TINY) in str(err.value) and "not the run's target" in str(err.value)
    assert not (tmp_path / "store" / "runs" / "r1" / "manifest.json").exists()  # refused before any write


def test_the_same_content_elsewhere_is_the_same_target(conn, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(TINY, copy)
    publish_endpoint(conn, str(copy), server="transformers")
    manifest, _ = _start_generate(conn, tmp_path, str(TINY))
    assert manifest.target.model == str(TINY)


def test_serve_section_makes_the_vllm_command(tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_TENSOR_PARALLEL_SIZE", "2")  # the run config wins over the host's .env
    path = tiny_run_config(tmp_path, "s1", serve={
        "tensor_parallel_size": 8, "pipeline_parallel_size": 2, "reasoning_parser": "kimi_k2",
        "trust_remote_code": True, "max_model_len": 65536, "extra_args": ["--max-num-seqs", "200"]})
    cfg = load_config(path)
    settings = load_settings(server="vllm", port=8000, host="0.0.0.0", vllm_command="/opt/vllm/bin/vllm")
    assert command(settings, "/models/kimi", cfg.serve) == [
        "/opt/vllm/bin/vllm", "serve", "/models/kimi", "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "2", "--reasoning-parser", "kimi_k2", "--max-model-len", "65536",
        "--trust-remote-code", "--max-num-seqs", "200"]
    assert cfg.serve.gpus == 16


def test_a_bad_serve_section_is_one_line_naming_the_field(tmp_path):
    path = tiny_run_config(tmp_path, "s2", serve={"tensor_parallel_size": 0, "tensor_paralel": 2})
    with pytest.raises(EyrieError) as err:
        load_config(path)
    assert "serve.tensor_parallel_size" in str(err.value) and "serve.tensor_paralel" in str(err.value)


def test_the_seed_example_says_how_kimi_is_served():
    cfg = load_config(ROOT / "examples" / "run.kimi-k2.5.yaml")
    assert cfg.serve.tensor_parallel_size == 8 and cfg.serve.reasoning_parser == "kimi_k2"
    assert cfg.serve.trust_remote_code


def test_the_stacks_inference_serves_the_active_runs_target_with_its_serve_section(conn, tmp_path):
    """`eyrie serve --run active` (the inference service's command in Compose): nothing in .env says
    which model or how; it waits for a pipeline to generate and serves that run's target.
    tests/fake_vllm stands in for the `vllm` command (eyrie's supervision is under test; real vLLM: tests/e2e/test_vllm_serve.py)."""
    import os
    import subprocess
    import time

    from tests.support.harness import BIN
    from tests.support.processes import free_port, stop
    from eyrie.data.manifest import config_key
    from eyrie.work import keys
    from eyrie_inference.server import generating_run

    url = conn.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/7"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EYRIE_REDIS_URL": redis_url,
           "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_SERVE_STOP_WHEN_DRAINED": "false",
           "PATH": f"{ROOT / 'tests' / 'fake_vllm'}:{BIN}:{os.environ['PATH']}"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve", "--server", "vllm", "--run", "active",
                             "--port", str(free_port())], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(3)
        assert proc.poll() is None and inference.read(conn) is None  # waiting for a run, serving nothing
        cfg = load_config(tiny_run_config(tmp_path, "act", serve={"tensor_parallel_size": 2, "max_model_len": 512}))
        store = open_store(load_settings(store_url=env["EYRIE_STORE_URL"]))
        store.put_json(config_key("act"), cfg.model_dump())
        conn.sadd(keys.ACTIVE_PIPELINES, "act")
        assert generating_run(conn, store) == "act"
        deadline = time.monotonic() + 60
        while not (inference.read(conn) and inference.read(conn).state == "ready"):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.3)
        endpoint = inference.read(conn)
        assert endpoint.model == str(TINY) and endpoint.max_model_len == 512
        text = log.read_text()
        assert "serving run act's target" in text and "--tensor-parallel-size 2 --max-model-len 512" in text
    finally:
        stop(proc)


def test_serve_extraction_and_verify_start_vllm_with_the_runs_one_serve_section(tmp_path):
    """The seed's example: `eyrie serve`, the vLLM extraction server and verify each start vLLM with
    the run's serve section (tensor parallel 8, trust_remote_code, the reasoning parser, the context
    length), not each with flags of its own."""
    from types import SimpleNamespace

    from eyrie_inference.extract_server import vllm_command
    from eyrie_trainer.verify import Served, serve_flags

    cfg = load_config(ROOT / "examples" / "run.kimi-k2.5.yaml")
    settings = load_settings(server="vllm", vllm_command="vllm", extract_shared_dir=str(tmp_path))
    model = "moonshotai/Kimi-K2.5"
    manifest = SimpleNamespace(target=SimpleNamespace(model=model),  # the fields extraction reads
                               extract=SimpleNamespace(max_length=cfg.extract.max_length, aux_layers=[2, 30, 58],
                                                       num_layers=61))
    served = command(settings, model, cfg.serve)
    extracting = vllm_command(settings, cfg, manifest)
    verifying = Served(settings, model, serve_flags(settings, cfg), tmp_path / "log").cmd

    def flags(cmd: list[str]) -> dict[str, str | None]:
        wanted = ("--tensor-parallel-size", "--trust-remote-code", "--reasoning-parser", "--max-model-len")
        after = {f: cmd[cmd.index(f) + 1: cmd.index(f) + 2] for f in wanted if f in cmd}
        return {f: (v[0] if v and not v[0].startswith("--") else None) for f, v in after.items()}

    expected = {"--tensor-parallel-size": "8", "--trust-remote-code": None, "--reasoning-parser": "kimi_k2",
                "--max-model-len": str(cfg.serve.max_model_len)}
    assert flags(served) == flags(extracting) == flags(verifying) == expected
    assert served[:3] == extracting[:3] == verifying[:3]  # the same vLLM, found the same way


def test_without_a_run_config_serve_and_verify_read_the_hosts_settings_one_way(tmp_path, monkeypatch):
    """The one fallback (ServeSection.of_host): `eyrie serve` alone and `eyrie verify` of a run with no
    stored config serve with the same EYRIE_* flags; verify once dropped tensor parallelism there."""
    from eyrie_trainer.verify import Served, serve_flags

    for name, value in {"EYRIE_TENSOR_PARALLEL_SIZE": "8", "EYRIE_REASONING_PARSER": "kimi_k2",
                        "EYRIE_MAX_MODEL_LEN": "16384", "EYRIE_VLLM_ARGS": "--trust-remote-code"}.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(server="vllm", vllm_command="vllm", port=8000, host="0.0.0.0")
    served = command(settings, "/models/kimi")
    verifying = Served(settings, "/models/kimi", serve_flags(settings, None), tmp_path / "log").cmd
    flags = ["--tensor-parallel-size", "8", "--reasoning-parser", "kimi_k2", "--max-model-len", "16384",
             "--trust-remote-code"]
    assert served[-len(flags):] == flags and all(f in verifying for f in flags), (served, verifying)
    assert verifying[verifying.index("--tensor-parallel-size") + 1] == "8"


def test_relative_target_and_dataset_paths_are_stored_absolute(tmp_path, monkeypatch):
    """The generator workers plan the run (its dataset read) and the servers load its target,
    each in its own working directory: the stored config names both absolutely."""
    from eyrie.stages.run_config import load_config

    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "examples" / "run.tiny.yaml")
    assert config.target.model == str(ROOT / "assets" / "tiny-target")
    assert config.dataset.source == str(ROOT / "tests" / "data" / "tiny_train_prompts.jsonl")
    hub = tmp_path / "hub.yaml"
    hub.write_text("run: h\ntarget: {model: org/model}\ndataset: {source: org/prompts}\n")
    assert (load_config(hub).target.model, load_config(hub).dataset.source) == ("org/model", "org/prompts")


def test_vllm_serves_in_float32_on_a_cpu_without_native_bf16_unless_told_otherwise(monkeypatch):
    from eyrie.core import vllm

    monkeypatch.setattr(vllm, "on_cpu", lambda: True)
    avx2 = "processor : 0\nflags : fpu sse avx avx2 fma\n"
    assert not vllm.cpu_native_bf16(avx2) and vllm.cpu_native_bf16(avx2.replace("avx2", "avx2 avx512_bf16"))
    cmd = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert vllm.with_cpu_dtype(cmd, native_bf16=False) == [*cmd, "--dtype", "float32"]
    assert vllm.with_cpu_dtype(cmd, native_bf16=True) == cmd
    assert vllm.with_cpu_dtype([*cmd, "--dtype", "bfloat16"], native_bf16=False) == [*cmd, "--dtype", "bfloat16"]
    assert vllm.with_cpu_dtype([*cmd, "--dtype=half"], native_bf16=False) == [*cmd, "--dtype=half"]
    monkeypatch.setattr(vllm, "on_cpu", lambda: False)  # a GPU host: vLLM's own choice
    assert vllm.with_cpu_dtype(cmd, native_bf16=False) == cmd


def test_vllm_on_a_cpu_pins_its_threads_to_this_process_cores_unless_told_or_serving_several_ranks(monkeypatch):
    from eyrie.core import vllm

    monkeypatch.setattr(vllm, "on_cpu", lambda: True)
    assert vllm.cpu_cores_bind({0, 1}) == "0-1" and vllm.cpu_cores_bind({3}) == "3"
    assert vllm.cpu_cores_bind({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"  # a cpuset with gaps, as vLLM parses it
    mine = vllm.cpu_cores_bind()
    cmd = ["vllm", "serve", "m"]
    assert vllm.with_cpu_binding(cmd, {"A": "1"}) == {"A": "1", "VLLM_CPU_OMP_THREADS_BIND": mine}
    assert vllm.with_cpu_binding(cmd, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
    for several in (["--tensor-parallel-size", "2"], ["-pp=2"], ["-tp", "2", "-pp", "2"]):  # one list per rank
        assert vllm.ranks([*cmd, *several]) >= 2 and vllm.with_cpu_binding([*cmd, *several], {}) == {}
    monkeypatch.setattr(vllm, "on_cpu", lambda: False)  # a GPU host: nothing to pin
    assert vllm.with_cpu_binding(cmd, {}) == {}
