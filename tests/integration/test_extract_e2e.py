"""Generate then extract on the tiny target (real Redis, real transformers serve, both stores):
what we wrote is read back by speculators' own data loading code and equals a direct forward
pass; fp8 halves the bytes; the storage budget refuses before any forward pass."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eyrie.core.config import load_settings
from eyrie.data.manifest import Layout, RunManifest, ShardManifest
from eyrie.data.store import open_store
from eyrie.work import keys
from tests.support.harness import TINY, eyrie

PROMPTS = [{"conversations": [{"from": "human", "value": q}]} for q in
           ("What is 4 plus 7?", "Say hello to Rosa.", "What is the opposite of dark?",
            "Repeat the word apple.", "What is 2 plus 3?")]
PROMPTS.insert(2, {"conversations": [{"from": "human", "value": "Add 8 and 4."},  # both answers the target's
                                     {"from": "gpt", "value": "DATASET-SENTINEL"},
                                     {"from": "human", "value": "Now say hello to Mia."}]})


def runs_of_ones(mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@pytest.fixture
def generated(env, tiny_server, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    eyrie("generate", "--dataset", str(data), "--run", "hs", "--concurrency", "3", "--max-tokens", "64",
          "--shard-size", "4", env=env)
    eyrie("worker", "generate", "--burst", env=env, timeout=600)
    return env


def test_extract_into_speculators_layout(generated, tmp_path):
    env = generated
    out = eyrie("extract", "--run", "hs", "--layers", "2,4,5", env=env)
    assert "extract 6 samples" in out.stdout and "2 tasks enqueued now" in out.stdout
    eyrie("worker", "extract", "--burst", env=env, timeout=600)

    store, layout = open_store(load_settings()), Layout("hs")
    run = RunManifest.model_validate(store.get_json(layout.manifest))
    assert run.extract.aux_layers == [2, 4, 5] and run.extract.hidden_size == 64
    shards = [ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(i))) for i in (0, 1)]
    assert sum(s.counts.done for s in shards) == 6 and all(not s.skip_reasons for s in shards)
    stored = sum(s.bytes for s in shards)
    assert abs(stored - run.extract.projected_bytes) / run.extract.projected_bytes < 0.02

    dest = tmp_path / "specdata"
    assert "6 samples" in eyrie("materialize", "hs", str(dest), env=env).stdout

    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=512, datapath=str(dest), on_missing="raise")
    assert len(dataset) == 6
    model, tokenizer = AutoModelForCausalLM.from_pretrained(TINY), AutoTokenizer.from_pretrained(TINY)
    for i in range(6):
        item = dataset[i]
        ids = item["input_ids"].tolist()
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([ref[j][0] for j in (2, 4, 5)], dim=-1)
        assert item["hidden_states"].shape == (len(ids), 3 * 64)
        torch.testing.assert_close(item["hidden_states"].float(), aux, atol=2e-2, rtol=1.6e-2)
        last = item["verifier_last_hidden_states"].float()  # pre-norm: norm(last) is HF's output
        torch.testing.assert_close(model.model.norm(last), ref[-1][0], atol=3e-2, rtol=3e-2)
        mask = item["loss_mask"].tolist()
        assert mask[0] == 0 and mask[-1] == 1 and 0 < sum(mask) < len(mask)
        assert runs_of_ones(mask) == (2 if i == 2 else 1)  # every answer supervised, the user turn between not
        if i == 2:
            between = tokenizer.decode([t for t, m in zip(ids, mask) if not m][-12:])
            assert "Now say hello to Mia." in between and "DATASET" not in tokenizer.decode(ids)

    status = json.loads(eyrie("status", "hs", "--json", env=env).stdout)["stages"]["extract"]
    assert (status["state"], status["done"], status["total"]) == ("done", 6, 6)
    assert status["bytes"] == stored and status["tokens"] == run.extract.tokens


def test_fp8_halves_the_bytes_and_truncation_is_counted(generated, tmp_path):
    env = generated
    eyrie("extract", "--run", "hs", "--dtype", "fp8", "--max-length", "20", env=env)
    eyrie("worker", "extract", "--burst", env=env, timeout=600)
    store, layout = open_store(load_settings()), Layout("hs")
    run = RunManifest.model_validate(store.get_json(layout.manifest))
    shards = [ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(i))) for i in (0, 1)]
    assert sum(s.truncated for s in shards) == run.extract.truncated > 0
    assert all(e["seq_len"] <= 20 for s in shards for e in s.samples)
    tokens = sum(e["seq_len"] for s in shards for e in s.samples)
    per_token = sum(s.bytes for s in shards) / tokens
    bf16_per_token = 4 * 64 * 2 + 8
    assert per_token <= 0.6 * bf16_per_token  # 4*64 fp8 + 4 scale + 8 id (+ headers) vs 4*64*2 + 8

    from hs_connectors.transfer import FP8Transfer
    from speculators.train.data import ArrowDataset

    dest = tmp_path / "fp8"
    eyrie("materialize", "hs", str(dest), env=env)
    dataset = ArrowDataset(max_len=512, datapath=str(dest), on_missing="raise",
                           transfer=FP8Transfer(dest / "hidden_states"))
    item = dataset[0]
    assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape[-1] == 3 * 64


def test_budget_and_layers_refused_before_any_forward(generated):
    env = generated
    result = eyrie("extract", "--run", "hs", "--layers", "2,2,9", env=env, check=False)
    assert result.returncode == 1 and "out of range [0, 8]" in result.stderr
    result = eyrie("extract", "--run", "hs", "--budget", "10kB", env=env, check=False)
    assert result.returncode == 1
    assert "needs" in result.stderr and "10.00 kB" in result.stderr and "--dtype fp8" in result.stderr
    store = open_store(load_settings())
    assert RunManifest.model_validate(store.get_json(Layout("hs").manifest)).extract is None
    assert not store.list("runs/hs/extract/")


def test_extract_before_generate_is_refused(env, tmp_path):
    result = eyrie("extract", "--run", "nothing", env=env, check=False)
    assert result.returncode == 1 and "unknown run" in result.stderr


def test_sigkilled_extractor_then_task_completed_exactly_once(env, stub_server, tmp_path):
    """Records with the server's token ids (the vLLM stand-in returns them): many small batches,
    the worker killed mid-task, a new worker completes it; every sample stored exactly once."""
    import signal
    import time

    import psutil

    from tests.support.harness import start_worker

    n = 600
    url = stub_server(tokens=48)
    genv = {**env, "EYRIE_INFERENCE_URL": url, "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(n)))
    eyrie("generate", "--dataset", str(data), "--run", "kill", "--shard-size", str(n), env=genv)
    eyrie("worker", "generate", "--burst", env=genv)

    xenv = {**env, "EYRIE_EXTRACT_BATCH_TOKENS": "120"}  # two samples a batch: many batches
    out = eyrie("extract", "--run", "kill", env=xenv)
    assert f"extract {n} samples" in out.stdout
    store, layout = open_store(load_settings()), Layout("kill")
    worker = start_worker(xenv, stage="extract")
    deadline = time.monotonic() + 120
    while len(store.list(layout.extract_parts(0))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in psutil.Process(worker.pid).children(recursive=True) + [psutil.Process(worker.pid)]:
        proc.send_signal(signal.SIGKILL)
    worker.wait()
    assert not store.exists(layout.extract_shard_manifest(0)), "finished before the kill: proves nothing"
    written_before = len([k for k in store.list(f"{layout.root}/extract/shards/") if k.endswith(".safetensors")])
    assert 0 < written_before < n

    conn = __import__("redis").Redis.from_url(env["EYRIE_REDIS_URL"])
    while conn.exists(keys.task_lease("extract-kill-00000")) and time.monotonic() < deadline + 60:
        time.sleep(0.5)  # the dead worker's lease lapses; a new worker takes the task over
    eyrie("worker", "extract", "--burst", env=xenv, timeout=600)

    shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(0)))
    ids = [s["sample_id"] for s in shard.samples]
    assert len(ids) == n == len(set(ids)) and shard.counts.done == n
    objects = [k for k in store.list(f"{layout.root}/extract/shards/") if k.endswith(".safetensors")]
    assert len(objects) == n and not store.list(layout.extract_parts(0))
    assert shard.mismatches == n  # the stand-in's ids are not what the chat template renders: counted
    assert all(s["source"] == "server_token_ids" and s["seq_len"] == 58 for s in shard.samples)


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_a_cancel_stops_a_running_extract_task_and_a_retry_finishes_it(env, stub_server, tmp_path):
    """Extract runs in the worker's own process (RQ cannot stop it): the task sees the cancel
    between batches, keeps what it stored and ends `cancelled`; the worker stays up; a retry
    finishes the shard with every sample once."""
    import signal
    import time

    from tests.support.harness import start_worker

    n = 600
    genv = {**env, "EYRIE_INFERENCE_URL": stub_server(tokens=48), "EYRIE_SERVER": "vllm", "EYRIE_MODEL": str(TINY)}
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
                            for i in range(n)))
    eyrie("generate", "--dataset", str(data), "--run", "stop", "--shard-size", str(n), env=genv)
    eyrie("worker", "generate", "--burst", env=genv)
    xenv = {**env, "EYRIE_EXTRACT_BATCH_TOKENS": "120"}
    eyrie("extract", "--run", "stop", env=xenv)
    store, layout = open_store(load_settings()), Layout("stop")
    worker = start_worker(xenv, burst=False, stage="extract")
    try:
        deadline = time.monotonic() + 120
        while len(store.list(layout.extract_parts(0))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        eyrie("cancel", "stop", env=env)
        stage = lambda: json.loads(eyrie("status", "stop", "--json", env=env).stdout)["stages"]["extract"]  # noqa: E731
        deadline = time.monotonic() + 60
        while stage()["state"] != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.3)
        assert stage()["state"] == "cancelled" and worker.poll() is None
        assert not store.exists(layout.extract_shard_manifest(0)), "finished before the cancel: proves nothing"
        assert store.list(layout.extract_parts(0))  # what it did is kept

        assert "1 tasks requeued" in eyrie("retry", "stop", env=env).stdout
        deadline = time.monotonic() + 300
        while not store.exists(layout.extract_shard_manifest(0)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
    shard = ShardManifest.model_validate(store.get_json(layout.extract_shard_manifest(0)))
    ids = [s["sample_id"] for s in shard.samples]
    assert len(ids) == n == len(set(ids))
