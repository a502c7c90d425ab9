"""`eyrie serve --server vllm` on real vLLM (its CPU build, in .venv-vllm): the endpoint published,
the GPU lease held while it serves and returned once it has exited; a generate stage through it
with a reasoning parser. One vLLM start for the whole module; on a Redis database of its own
(this server publishes itself as the default endpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import orjson
import pytest
import redis
from transformers import AutoTokenizer

from conftest import BIN, TINY, eyrie, free_port, wait_for
from eyrie import inference
from eyrie.gpu import holder
from eyrie.manifest import Layout
from vllm_real import SMALL, START_S, vllm_env

PROMPTS = [{"conversations": [{"from": "human", "value": text}]} for text in
           ("Add 3 and 4.", "What color is the Zib?", "Say hello to Alice.", "Repeat the word river.")]
PROMPTS.append({"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                                  {"from": "human", "value": "What is the opposite of hot?"}]})


@pytest.fixture(scope="module")
def served(redis_server, tmp_path_factory):
    """`eyrie serve --server vllm` with the deepseek_r1 reasoning parser, on Redis db 7."""
    tmp = tmp_path_factory.mktemp("vllm-serve")
    url, port = redis_server.rsplit("/", 1)[0] + "/7", free_port()
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    env = vllm_env(tmp / "vllm-cache", {
        "EYRIE_REDIS_URL": url, "EYRIE_SERVER": "vllm", "EYRIE_PORT": str(port), "EYRIE_MODEL": str(TINY),
        "EYRIE_REASONING_PARSER": "deepseek_r1", "EYRIE_VLLM_ARGS": " ".join(SMALL[2:]),
        "EYRIE_MAX_MODEL_LEN": SMALL[1], "EYRIE_SERVE_STOP_WHEN_DRAINED": "false"})
    log = tmp / "serve.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or ((e := inference.read(conn)) and e.state == "ready"),
                 "vLLM behind eyrie serve to be ready", timeout=START_S, every=1)
        if proc.poll() is not None:
            pytest.fail(f"eyrie serve exited: {log.read_text()[-4000:]}")
        yield {"proc": proc, "conn": conn, "env": env, "log": log, "port": port, "tmp": tmp}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(90)


def test_serve_starts_real_vllm_publishes_it_and_holds_the_gpu_lease(served):
    endpoint = inference.read(served["conn"])
    assert endpoint.server == "vllm" and endpoint.state == "ready" and endpoint.model == str(TINY)
    assert endpoint.url.endswith(f":{served['port']}") and endpoint.max_model_len == 256
    assert holder(served["conn"])["holder"]["owner"].startswith("inference@")
    shown = served["log"].read_text()
    assert "-m vllm.entrypoints.openai.api_server --model" in shown and "--reasoning-parser deepseek_r1" in shown


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_generate_through_vllm_records_its_reasoning_and_token_ids(served, env, tmp_path):
    env = {**env, "EYRIE_REDIS_URL": served["env"]["EYRIE_REDIS_URL"]}
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    eyrie("generate", "--dataset", str(data), "--run", "via-vllm", "--concurrency", "4", "--max-tokens", "64",
          env=env)
    eyrie("worker", "generate", "--burst", env=env, timeout=600)

    from eyrie.config import load_settings
    from eyrie.store import open_store

    os.environ["EYRIE_STORE_URL"] = env["EYRIE_STORE_URL"]
    store, layout = open_store(load_settings()), Layout("via-vllm")
    manifest = store.get_json(layout.generate_shard_manifest(0))
    records = [orjson.loads(line) for line in store.get_bytes(manifest["object"]).splitlines()]
    assert [r["status"] for r in records] == ["done"] * len(PROMPTS)
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    for r in records:
        # vLLM's deepseek_r1 parser split <think>…</think> into the response's `reasoning`
        assert r["reasoning_source"] == "reasoning" and r["reasoning"] and "<think>" not in r["content"]
        assert r["finish_reason"] == "stop"
        turn = {"role": "assistant", "content": r["content"], "reasoning_content": r["reasoning"]}
        rendered = tokenizer.apply_chat_template(r["messages"] + [turn], tokenize=True, return_dict=False)
        assert r["prompt_token_ids"] + r["completion_token_ids"] == list(rendered)
    answers = {r["messages"][-1]["content"]: r["content"] for r in records}
    assert answers["Add 3 and 4."] == "The answer is 7."
    assert store.get_json(layout.manifest)["target"]["server"] == "vllm"


def test_stopped_serve_stops_vllm_and_returns_the_gpu_lease(served):
    """Last in this module: SIGTERM to eyrie serve, as Compose stops it."""
    os.kill(served["proc"].pid, signal.SIGTERM)
    assert served["proc"].wait(120) == 0
    assert (holder(served["conn"]) or {}).get("holder") is None
    assert inference.read(served["conn"]).state == "stopped"
    assert _no_server_on(served["port"])  # vLLM exited before the lease was returned


def _no_server_on(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0
