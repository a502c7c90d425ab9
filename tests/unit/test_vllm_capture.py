"""The vLLM extraction backend (eyrie_extractor.vllm_backend) against a test double in this process:
a small aiohttp server that answers /v1/completions as vLLM does when started with
`extract_command` (speculative method `extract_hidden_states` + ExampleHiddenStatesConnector).
It reads its layer ids and shared directory from that very command line, holds a `.lock` file
while it writes `{shared}/{request id}.safetensors` (`hidden_states [seq, n_ids, H]` bf16,
`token_ids` int64) after it has answered, and returns the path in
`kv_transfer_params["hidden_states_path"]` beside `choices[0].prompt_token_ids`, where
speculators' `extract_output` reads them. The hidden states are a known function of (token id,
position, layer id), so every value VllmCapture returns can be checked.
Real vLLM behind it: tests/e2e/test_vllm_backend.py. The double stays for what the real server cannot be
made to do on demand: wrong ids, wrong shapes, a missing connector, a slow writer.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shlex
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie_extractor.vllm_backend import VllmCapture, VllmCaptureError, extract_command, main
from tests.support.harness import TINY

MODEL = "org/huge-moe"  # the double serves any name; a 1T MoE is what this backend is for
NUM_LAYERS, HIDDEN = 8, 16


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def fake_states(ids: list[int], layer_ids: list[int], hidden: int) -> torch.Tensor:
    """[seq, n, H], exact in bf16 (multiples of 1/8 in [-4, 4)), different for every token id,
    position and layer, so a swapped row, column or shift shows."""
    t = torch.tensor(ids).view(-1, 1, 1)
    pos = torch.arange(len(ids)).view(-1, 1, 1)
    layer = torch.tensor(layer_ids).view(1, -1, 1)
    h = torch.arange(hidden).view(1, 1, -1)
    return (((t * 7 + pos * 5 + layer * 3 + h) % 61).float() / 8 - 4).to(torch.bfloat16)


class VllmDouble:
    """vLLM's /v1/completions in extract_hidden_states mode, configured by extract_command's JSON.

    faults: prompt length -> what goes wrong for that request ("prompt_ids": other
    prompt_token_ids in the response; "file_ids": other token_ids in the file; "shape": a wrong
    hidden size in the file; "no_kv": no kv_transfer_params, as a server without the connector)."""

    def __init__(self, cmd: list[str], hidden: int, write_delay_s: float = 0.05):
        spec = json.loads(flag(cmd, "--speculative-config"))
        kv = json.loads(flag(cmd, "--kv-transfer-config"))
        assert spec["method"] == "extract_hidden_states"
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector"
        self.model, self.hidden, self.write_delay_s = cmd[2], hidden, write_delay_s
        self.layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        self.shared = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
        self.faults: dict[int, str] = {}
        self.requests: list[dict] = []
        self.writers: list[threading.Thread] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        ids = body["prompt"]
        if body["model"] != self.model:
            return web.json_response({"error": {"message": f"The model `{body['model']}` does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                and body.get("max_tokens") == 1):
            return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
        fault = self.faults.get(len(ids))
        req_id = f"cmpl-{uuid.uuid4().hex}-0"
        path = self.shared / f"{req_id}.safetensors"
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if body.get("return_token_ids"):
            choice |= {"prompt_token_ids": ids[::-1] if fault == "prompt_ids" else ids, "token_ids": [5]}
        response = {"id": req_id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model, "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}}
        if fault != "no_kv":
            # As the connector: the lock exists (held) before the client gets the path; the file
            # is written after the answer, then the lock released.
            self.shared.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            writer = threading.Thread(target=self._write, args=(path, ids, fault, lock_fd))
            self.writers.append(writer)
            writer.start()
            response["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return web.json_response(response)

    def _write(self, path: Path, ids: list[int], fault: str | None, lock_fd: int) -> None:
        try:
            time.sleep(self.write_delay_s)
            states = fake_states(ids, self.layer_ids, self.hidden - (fault == "shape"))
            token_ids = torch.tensor(ids, dtype=torch.long)
            if fault == "file_ids":
                token_ids[len(ids) // 2] += 1
            save_file({"hidden_states": states, "token_ids": token_ids}, str(path))
        finally:
            os.close(lock_fd)

    def close(self) -> None:
        for writer in self.writers:
            writer.join(10)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def serve(tmp_path):
    """Factory: the double started from extract_command's command line; a capture on it."""
    doubles, captures = [], []

    def start(aux_layers: list[int], **capture_kwargs) -> tuple[VllmDouble, VllmCapture]:
        cmd = extract_command(MODEL, aux_layers, tmp_path / "shared", 1, 8000, [], num_layers=NUM_LAYERS)
        double = VllmDouble(cmd, HIDDEN)
        doubles.append(double)
        capture = VllmCapture(double.url, MODEL, aux_layers, NUM_LAYERS, HIDDEN, timeout_s=30,
                              **capture_kwargs)
        captures.append(capture)
        return double, capture

    yield start
    for capture in captures:
        capture.close()
    for double in doubles:
        double.close()


def leftovers(double: VllmDouble) -> list[str]:
    return sorted(p.name for p in double.shared.iterdir()) if double.shared.exists() else []


BATCH = [[11, 3, 250, 7, 9], list(range(100, 112)), [42], [5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("aux_layers", [[2, 4, 5], [5, 2], [2, 8]],
                         ids=["sorted", "unsorted-keeps-hf-order", "aux-includes-last"])
def test_forward_returns_each_sequence_right_padded(serve, aux_layers):
    double, capture = serve(aux_layers)
    states = capture.forward(BATCH)

    assert states.shape == (len(BATCH), 12, len(aux_layers) + 1, HIDDEN) and states.dtype == torch.bfloat16
    for row, ids in enumerate(BATCH):
        # Column k is layer (aux_layers + [num_layers])[k], as HFCapture orders them.
        assert torch.equal(states[row, : len(ids)], fake_states(ids, aux_layers + [NUM_LAYERS], HIDDEN))
        assert not states[row, len(ids):].any()
    assert double.layer_ids == sorted(set(aux_layers) | {NUM_LAYERS})
    assert leftovers(double) == []  # every file and lock deleted after reading
    assert sorted(r["prompt"] for r in double.requests) == sorted(BATCH)
    assert all(r["model"] == MODEL and r["max_tokens"] == 1 and r["return_token_ids"] is True
               for r in double.requests)


def test_sequences_of_a_batch_are_requested_concurrently(serve):
    double, capture = serve([2, 4, 5])
    double.write_delay_s = 0.5
    t0 = time.monotonic()
    capture.forward([[i + 1] * (i + 2) for i in range(8)])
    assert time.monotonic() - t0 < 2.5  # serial would be 8 x 0.5 s
    assert leftovers(double) == []


@pytest.mark.parametrize("fault, words", [
    ("file_ids", ["token ids in", "differ from the ids sent", "sent 7 ids, got 7",
                  "position 3 (sent 8, got 9)"]),
    ("prompt_ids", ["prompt_token_ids differ from the ids sent", "position 0 (sent 5, got 11)"]),
    ("shape", ["has shape [7, 4, 15], expected [7, 4, 16]", "layer ids [2, 4, 5, 8]"]),
    ("no_kv", ["missing kv_transfer_params", "extract_hidden_states"]),
])
def test_a_wrong_answer_raises_a_clear_error_and_leaves_no_file(serve, fault, words):
    double, capture = serve([2, 4, 5])
    double.faults[7] = fault  # the fourth sequence of BATCH only
    with pytest.raises(VllmCaptureError) as err:
        capture.forward(BATCH)
    message = str(err.value)
    assert "sequence 3 of the batch (7 tokens)" in message and double.url in message
    for word in words:
        assert word in message, message
    assert len(message) < 600  # long sequences are summarized, not dumped
    assert len(double.requests) == len(BATCH) and leftovers(double) == []


def test_a_server_that_does_not_serve_the_model_fails_with_its_answer(serve):
    double, capture = serve([2, 4, 5], max_retries=0)
    capture.model = "other/model"
    with pytest.raises(VllmCaptureError, match=r"failed after 1 attempts: NotFoundError.*does not exist"):
        capture.forward([[1, 2, 3]])


def test_extract_command_carries_the_layers_and_shared_dir(tmp_path):
    shared = tmp_path / "hs"
    cmd = extract_command(str(TINY), [5, 2, 4], shared, tensor_parallel_size=8, port=8123,
                          extra_args="--max-model-len 4096 --enforce-eager", host="0.0.0.0")
    assert cmd[:3] == ["vllm", "serve", str(TINY)]
    assert [flag(cmd, f) for f in ("--host", "--port", "--tensor-parallel-size")] == ["0.0.0.0", "8123", "8"]
    assert cmd[-3:] == ["--max-model-len", "4096", "--enforce-eager"]
    # num_layers read from the target's config (8), appended as the last layer; ascending.
    assert json.loads(flag(cmd, "--speculative-config")) == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}}}
    assert json.loads(flag(cmd, "--kv-transfer-config")) == {
        "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)}}
    # The same JSON that hs-connectors' file backend (speculators' launcher default) builds.
    from argparse import Namespace

    from hs_connectors.transfer import FileBackend
    assert json.loads(flag(cmd, "--kv-transfer-config")) == FileBackend.build_kv_transfer_config(
        Namespace(hidden_states_path=str(shared)))
    with pytest.raises(EyrieError, match="out of range"):
        extract_command(str(TINY), [2, 9], shared)
    with pytest.raises(EyrieError, match="not distinct"):
        extract_command(str(TINY), [2, 2], shared, num_layers=8)


def test_module_prints_the_command(tmp_path, capsys, monkeypatch):
    """Its vLLM by default: Settings.vllm_command (EYRIE_VLLM_COMMAND), found as every start of vLLM finds it."""
    monkeypatch.delenv("EYRIE_VLLM_COMMAND", raising=False)
    assert main([str(TINY), "--layers", "2,4,5", "--shared-dir", str(tmp_path), "--port", "9000", "--",
                 "--max-model-len", "512"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed == extract_command(str(TINY), [2, 4, 5], tmp_path, 1, 9000, ["--max-model-len", "512"],
                                      vllm_command=load_settings().vllm_command)
    monkeypatch.setenv("EYRIE_VLLM_COMMAND", "/opt/vllm/bin/vllm")
    assert main([str(TINY), "--layers", "2,4,5", "--shared-dir", str(tmp_path)]) == 0
    assert shlex.split(capsys.readouterr().out)[:2] == ["/opt/vllm/bin/vllm", "serve"]
    assert main([str(TINY), "--layers", "2,4,5", "--shared-dir", str(tmp_path), "--vllm-command", "vllm"]) == 0
    assert shlex.split(capsys.readouterr().out)[:2] == ["vllm", "serve"]
