"""The vLLM extraction backend (eyrie_extractor.vllm_backend) on real vLLM (its CPU build, .venv-vllm),
started on the tiny target with `extract_command`: its states equal the HF backend's, and an engine
that dies after answering (the stock connector on the CPU) is named as the cause. Against a test
double, in this process: tests/unit/test_vllm_capture.py.
"""

from __future__ import annotations

import pytest
import torch

from eyrie_extractor.vllm_backend import VllmCapture, VllmCaptureError, connector_env, extract_command
from tests.support.harness import TINY
from tests.support.processes import free_port
from tests.support.vllm_real import SMALL, VLLM_PYTHON, start_vllm, stop_vllm, vllm_env
from tests.unit.test_vllm_capture import NUM_LAYERS


@pytest.fixture(scope="module")
def extraction_server(tmp_path_factory):
    """Real vLLM (CPU build) on the tiny target, started with extract_command(..., cpu=True):
    our CpuHiddenStatesConnector, loaded by vLLM through kv_connector_module_path; fp32."""
    tmp = tmp_path_factory.mktemp("vllm-extract")
    aux, port, shared = [2, 4, 5], free_port(), tmp / "hs"
    cmd = extract_command(str(TINY), aux, shared, 1, port, [*SMALL, "--dtype", "float32"],
                          vllm_command=str(VLLM_PYTHON), cpu=True)
    proc = start_vllm(cmd, tmp / "vllm.log", connector_env(vllm_env(tmp / "cache")), port)
    yield f"http://127.0.0.1:{port}", aux, shared
    stop_vllm(proc)


def test_real_vllm_states_equal_the_hf_backend(extraction_server):
    """The same hidden states as HFCapture's fp32 forward, every file read and deleted."""
    from transformers import AutoTokenizer

    from eyrie_extractor.capture import HFCapture

    url, aux, shared = extraction_server
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    batch = [tokenizer(text)["input_ids"] for text in
             ("What is 4 plus 7?", "Say hello to Rosa, then count to twenty slowly.", "Hi")]
    capture = VllmCapture(url, str(TINY), aux, NUM_LAYERS, 64, timeout_s=120)
    try:
        got = capture.forward(batch)
    finally:
        capture.close()
    want = HFCapture(str(TINY), aux, "cpu", dtype=torch.float32).forward(batch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    for row, ids in enumerate(batch):
        torch.testing.assert_close(got[row, : len(ids)], want[row, : len(ids)], atol=1e-4, rtol=1e-4)
    assert sorted(p.name for p in shared.iterdir()) == []


def test_an_engine_that_dies_after_answering_is_named_as_the_cause(tmp_path):
    """vLLM's stock connector on its CPU build: the server answers with a file path, then its
    engine dies (pinned host memory, refused by CPU torch) and the file never appears."""
    port = free_port()
    cmd = extract_command(str(TINY), [2, 4, 5], tmp_path / "hs", 1, port, SMALL, vllm_command=str(VLLM_PYTHON))
    proc = start_vllm(cmd, tmp_path / "vllm.log", vllm_env(tmp_path / "cache"), port)
    capture = VllmCapture(f"http://127.0.0.1:{port}", str(TINY), [2, 4, 5], NUM_LAYERS, 64, timeout_s=60,
                          max_retries=0)
    try:
        with pytest.raises(VllmCaptureError) as err:
            capture.forward([[2, 5, 289, 302, 288, 296, 20, 3, 6]])
    finally:
        capture.close()
        stop_vllm(proc)
    assert "engine died after answering" in str(err.value) and "mount" not in str(err.value)
