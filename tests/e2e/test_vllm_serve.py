"""`eyrie serve --server vllm` on real vLLM (its CPU build, in .venv-vllm): the endpoint published,
the GPU lease held while it serves; a generate stage through it with a reasoning parser; the
server stopping by itself once a pipeline's generation drains, handing the lease over only after
vLLM has exited. One vLLM start for the whole module; on a Redis database of its own
(this server publishes itself as the default endpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import orjson
import pytest
import redis
from transformers import AutoTokenizer

from eyrie.data.manifest import Layout
from eyrie.work import inference
from eyrie.work.gpu import GpuLease, holder
from tests.support.harness import BIN, ROOT, TINY, eyrie, state_of, tiny_run_config, wait_for
from tests.support.processes import free_port
from tests.support.vllm_real import SMALL, START_S, VLLM_PYTHON, vllm_env

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
    shared = {"EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": f"file://{tmp / 'store'}"}  # the tests' too
    env = vllm_env(tmp / "vllm-cache", {
        **shared, "EYRIE_SERVER": "vllm", "EYRIE_PORT": str(port), "EYRIE_MODEL": str(TINY),
        "EYRIE_REASONING_PARSER": "deepseek_r1", "EYRIE_VLLM_ARGS": " ".join(SMALL[2:]),
        "EYRIE_MAX_MODEL_LEN": SMALL[1]})  # stops by itself once a pipeline's generation drains
    log = tmp / "serve.log"
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or ((e := inference.read(conn)) and e.state == "ready"),
                 "vLLM behind eyrie serve to be ready", timeout=START_S, every=1)
        if proc.poll() is not None:
            pytest.fail(f"eyrie serve exited: {log.read_text()[-4000:]}")
        yield {"proc": proc, "conn": conn, "shared": shared, "log": log, "port": port}
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
def test_generate_through_vllm_records_its_reasoning_and_token_ids(served, env, tmp_path, monkeypatch):
    env = {**env, **served["shared"]}
    monkeypatch.setenv("EYRIE_STORE_URL", env["EYRIE_STORE_URL"])
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    eyrie("generate", "--dataset", str(data), "--run", "via-vllm", "--concurrency", "4", "--max-tokens", "64",
          env=env)
    eyrie("worker", "generate", "--burst", env=env, timeout=600)

    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store

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


@pytest.mark.parametrize("store_env", ["file"], indirect=True)
def test_vllm_stops_and_hands_the_gpus_over_when_generation_drains(served, env, tmp_path, workers):
    """Last in this module: a pipeline's generation drains while its later stages wait; eyrie serve
    stops vLLM by itself and the waiting extractor gets the lease (never two owners)."""
    env = {**env, **served["shared"]}  # the server sees the pipeline in the same Redis and store
    conn = served["conn"]
    extractor, got = GpuLease(conn, "extractor@test"), []
    waiting = threading.Thread(target=lambda: got.append(extractor.acquire(wait_s=300, poll_s=0.1)))
    waiting.start()
    workers.env = env
    workers.start("generate")
    eyrie("run", "--config", tiny_run_config(tmp_path, "handover", dataset={"limit": 12}), env=env)
    wait_for(lambda: "extractor@test" in (holder(conn) or {}).get("waiting", []), "the extractor waiting")
    assert got == [] and holder(conn)["holder"]["owner"].startswith("inference@")  # never two owners
    assert served["proc"].wait(300) == 0  # drained: eyrie serve stopped vLLM by itself ...
    waiting.join(60)
    assert got == [True] and holder(conn)["holder"]["owner"] == "extractor@test"  # ... and handed over
    assert _no_server_on(served["port"])  # vLLM exited before the lease was returned
    assert "generation has drained" in served["log"].read_text()
    status = json.loads(eyrie("status", "handover", "--json", env=env).stdout)
    assert status["stages"]["generate"]["state"] == "done"
    assert status["pipeline"]["tasks"]["plan-extract"]["state"] == "queued"  # for the extractor, which has the GPUs now
    assert status["inference"]["state"] == "stopped"
    extractor.release()


def _no_server_on(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_vllm_command_setting_names_an_executable_or_a_python(tmp_path, monkeypatch):
    """No process: EYRIE_VLLM_COMMAND as the real server's command line starts; unset, `vllm` on
    PATH (a GPU image's), else the project's own .venv-vllm."""
    from eyrie.core.config import load_settings
    from eyrie.core.vllm import available
    from eyrie_inference.server import command

    python = load_settings(server="vllm", vllm_command=str(VLLM_PYTHON), port=8123)
    assert command(python, "m")[:5] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    monkeypatch.delenv("EYRIE_VLLM_COMMAND", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert command(load_settings(server="vllm"), "m")[:3] == [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fake_vllm'}:/usr/bin:/bin")
    assert command(load_settings(server="vllm"), "m")[:3] == ["vllm", "serve", "m"]
    assert available(str(VLLM_PYTHON)) and not available(str(tmp_path / "python")) and not available("no-such-vllm")


def test_sigterm_while_vllm_loads_stops_it_whole_and_returns_the_lease(redis_server, tmp_path):
    """`eyrie serve` stopped while vLLM still loads: it exits at once, and nothing of vLLM (its API
    server, its engine core) is left running; the GPU lease is free for the next owner."""
    url, port = redis_server.rsplit("/", 1)[0] + "/8", free_port()
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    env = vllm_env(tmp_path / "vllm-cache", {
        "EYRIE_REDIS_URL": url, "EYRIE_STORE_URL": f"file://{tmp_path / 'store'}", "EYRIE_SERVER": "vllm",
        "EYRIE_PORT": str(port), "EYRIE_MODEL": str(TINY), "EYRIE_VLLM_ARGS": " ".join(SMALL[2:]),
        "EYRIE_MAX_MODEL_LEN": SMALL[1]})
    proc = subprocess.Popen([str(BIN / "eyrie"), "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (e := inference.read(conn)) and e.state == "starting" and vllm_pids(port),
                 "vLLM loading behind eyrie serve", timeout=120, every=0.5)
        loading = vllm_pids(port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in loading), "vLLM's processes gone",
             timeout=40, every=0.5)
    assert inference.read(conn).state == "stopped" and holder(conn) is None


def vllm_pids(port: int) -> list[int]:
    """Processes whose command line serves on this port, and their children (vLLM's engine core)."""
    def cmdline(pid: str) -> str:
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    servers = {p for p in pids if "vllm.entrypoints" in cmdline(p) and f"--port {port}" in cmdline(p)}
    children = {p for p in pids if state_of(int(p), field=3) in servers}
    return sorted(int(p) for p in servers | children)
