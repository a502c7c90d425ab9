"""`eyrie run --plan` in hours and bytes, every copy counted, and the vLLM support check, all
from the config alone (issue 14)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from eyrie.core.support import check, table
from tests.support.harness import OFFLINE, ROOT, TINY, TRAIN_PROMPTS, eyrie, eyrie_in_process, tiny_run_config

SEED = ROOT / "examples" / "run.kimi-k2.5.yaml"


def _env(tmp_path) -> dict:
    return {**os.environ, **OFFLINE, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}",
            "EYRIE_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.integration  # the real console script, once
def test_the_seed_plans_hours_bytes_and_support_with_no_gpu(tmp_path):
    out = eyrie("run", "--config", str(SEED), "--plan", env=_env(tmp_path)).stdout
    assert "expected 2.94 TB in fp8" in out  # 25,000 x 4,096 x (4 states x 7,168 x 1 byte + scale + id)
    # extract.storage: auto takes hybrid: the bucket and the trainer's copy hold what the 2.8 TB budget allows
    assert "every copy (expected mean, hybrid): bucket 2.80 TB (hidden states + records), the trainer's local " \
           "copy 2.80 TB" in out
    assert "every stored token is trained on" in out
    assert "extract      9.77 h: 102,400,000 tokens stored at 2,912 tok/s (the seed" in out
    assert "generate     4.98 h" in out and "total" in out
    assert "KimiK25ForConditionalGeneration (vllm/model_executor/models/kimi_k25.py) implements SupportsEagle3" in out
    plan = json.loads(eyrie_in_process("run", "--config", str(SEED), "--plan", "--json", env=_env(tmp_path)).stdout)
    assert plan["hours"]["extract"]["tokens_per_s"] == 2912 and plan["support"]["eagle3"] is True
    assert plan["space"]["trainer_copy_bytes"] == plan["storage"]["modes"]["hybrid"]["trainer_cache_bytes"]
    assert plan["storage"]["modes"]["offline"]["trainer_cache_bytes"] == plan["hidden_states_bytes_expected"]
    assert plan["lengths"]["unseen_tokens_upper_bound"] == 0


def test_free_space_counts_the_bucket_and_the_trainers_copy_on_one_device(tmp_path):
    path = tiny_run_config(tmp_path, "p1", plan={"mean_tokens": 200, "generate_tokens_per_s": 1000,
                                                  "extract_tokens_per_s": 4000, "train_tokens_per_s": 8000})
    plan = json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json", env=_env(tmp_path)).stdout)
    space = plan["space"]
    assert space["same_device"] and abs(space["bucket_free"] - shutil.disk_usage(tmp_path).free) < 2e9
    assert space["fits_bucket"] is True
    rows = plan["samples"]
    assert plan["hours"]["extract"]["hours"] == round(rows * 200 / 4000 / 3600, 2)
    assert plan["hours"]["train"]["tokens"] == rows * 200 * 3  # 3 epochs of tiny_run_config


def test_a_training_length_shorter_than_extraction_is_counted(tmp_path):
    path = tiny_run_config(tmp_path, "p2", extract={"max_length": 300}, train={"seq_len": 256})
    out = eyrie_in_process("run", "--config", path, "--plan", env=_env(tmp_path)).stdout
    assert "training cuts at 256: up to 13,464 stored tokens are never trained on" in out  # 306 rows x 44
    assert "(set train.seq_len: 300 or extract.max_length: 256)" in out


def test_no_rate_known_says_which_to_give(tmp_path):
    out = eyrie_in_process("run", "--config", tiny_run_config(tmp_path, "p3"), "--plan", env=_env(tmp_path)).stdout
    assert "unknown: set plan.generate_tokens_per_s" in out and "total: unknown until every rate is given" in out


def _unsupported_config(tmp_path, backend: str) -> str:
    body = {"run": "g3", "target": {"model": "google/gemma-3-27b-it", "shape": {
        "hidden_size": 5376, "num_hidden_layers": 62, "vocab_size": 262208, "architecture": "Gemma3ForCausalLM"}},
        "dataset": {"source": str(TRAIN_PROMPTS)}, "extract": {"backend": backend}}
    path = tmp_path / f"g3-{backend}.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


@pytest.mark.integration  # the real console script, once
def test_an_architecture_without_eagle3_in_vllm_is_refused_before_any_gpu_work(tmp_path):
    result = eyrie_in_process("run", "--config", _unsupported_config(tmp_path, "vllm"), "--plan", env=_env(tmp_path), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "Gemma3ForCausalLM (vllm/model_executor/models/gemma3.py) does not implement SupportsEagle3" in result.stderr
    assert "set extract.backend: hf" in result.stderr
    started = eyrie("run", "--config", _unsupported_config(tmp_path, "vllm"), env=_env(tmp_path), check=False)
    assert started.returncode == 1 and "set extract.backend: hf" in started.stderr  # refused before Redis
    hf = eyrie_in_process("run", "--config", _unsupported_config(tmp_path, "hf"), "--plan", env=_env(tmp_path))
    assert "cannot serve an EAGLE-3 drafter for Gemma3ForCausalLM" in hf.stdout


def test_the_table_is_vllm_0_33_and_says_what_the_docs_say():
    t = table()
    assert t["vllm"] == "0.33.0" and len(t["architectures"]) > 300
    assert check("KimiK25ForConditionalGeneration", "vllm")["eagle3"] is True
    assert check("DeepseekV3ForCausalLM", "vllm")["eagle3"] is True
    assert check("LlamaForCausalLM", "vllm")["eagle3"] is True
    assert check("NoSuchForCausalLM", "vllm")["refusal"] is not None
    assert check(str(TINY and "LlamaForCausalLM"), "hf")["refusal"] is None


@pytest.mark.integration  # runs scripts/vllm_eagle3_table.py as a process
def test_the_table_script_reads_classes_and_their_bases(tmp_path):
    """scripts/vllm_eagle3_table.py on a source tree shaped like vLLM's (real files, two models)."""
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (tmp_path / "vllm" / "models").mkdir()
    (models / "registry.py").write_text('_TEXT = {"AForCausalLM": ("a", "AForCausalLM"), '
                                        '"BForCausalLM": ("b", "BForCausalLM"), "CModel": ("b", "CModel")}\n')
    (models / "a.py").write_text("class AForCausalLM(nn.Module, SupportsPP, SupportsEagle3):\n    pass\n")
    (models / "b.py").write_text("from .a import AForCausalLM\nclass BForCausalLM(AForCausalLM):\n    pass\n"
                                 "class CModel(nn.Module):\n    pass\n")
    (tmp_path / "vllm" / "_version.py").write_text("version = '9.9.9'\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_eagle3_table.py"), str(tmp_path / "vllm")],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)["architectures"]
    assert json.loads(out)["vllm"] == "9.9.9"
    assert rows == {"AForCausalLM": ["vllm/model_executor/models/a.py", "AForCausalLM", True],
                    "BForCausalLM": ["vllm/model_executor/models/b.py", "BForCausalLM", True],
                    "CModel": ["vllm/model_executor/models/b.py", "CModel", False]}


def test_generation_rate_is_measured_once_the_run_has_generated(env, stub_server, tmp_path):
    url = stub_server(latency=1.0, tokens=50)
    env = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm"}
    eyrie("generate", "--dataset", str(TRAIN_PROMPTS), "--run", "pm", "--limit", "16", "--concurrency", "4",
          "--max-tokens", "64", env=env)
    eyrie("worker", "generate", "--burst", env=env)
    path = tiny_run_config(tmp_path, "pm", dataset={"limit": 16}, plan={"generate_tokens_per_s": 1.0})
    plan = json.loads(eyrie_in_process("run", "--config", path, "--plan", "--json", env=env).stdout)
    rate = plan["hours"]["generate"]
    assert rate["source"] == "measured: this run's 1 generated shard(s)"
    assert 800 / 12 <= rate["tokens_per_s"] <= 800 / 2  # 16 x 50 tokens in 4 waves of 1 s (C=4), to the second
