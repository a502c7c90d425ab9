"""The vLLM extraction server's command and environment, from the run (eyrie_inference.extract_server),
without a process: served under the lease and supervised in tests/e2e/test_extract_server.py."""

import pytest

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.vllm import CPU_KV_CACHE_GIB, SERVER_MODULE, serve_env
from eyrie_inference.extract_server import vllm_command
from tests.e2e.test_extract_server import _config, _manifest
from tests.support.harness import ROOT, TINY


def test_the_extraction_servers_command_comes_from_the_run(tmp_path):
    settings = load_settings(extract_shared_dir=str(tmp_path / "hs"), port=8100, host="0.0.0.0",
                             vllm_command="/opt/vllm/bin/vllm")
    cmd = vllm_command(settings, _config(), _manifest())
    assert cmd[:9] == ["/opt/vllm/bin/vllm", "serve", str(TINY), "--host", "0.0.0.0", "--port", "8100",
                       "--tensor-parallel-size", "2"]
    joined = " ".join(cmd)
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in joined and str(tmp_path / "hs") in joined
    # no GPU here: vLLM's CPU build loads our CPU-safe connector (the stock one pins memory and dies)
    assert "CpuHiddenStatesConnector" in joined and "ExampleHiddenStatesConnector" not in joined
    assert cmd[-3:] == ["--max-model-len", "600", "--trust-remote-code"]
    # a config naming the target by a relative path: vLLM serves the name the extractor asks for,
    # the manifest's (made absolute when the run was planned), or every request is a 404
    relative = _config().model_copy(update={"target": _config().target.model_copy(update={"model": "assets/tiny-target"})})
    assert vllm_command(settings, relative, _manifest())[2] == str(TINY)
    with pytest.raises(EyrieError, match="set serve.max_model_len to at least 513"):
        vllm_command(settings, _config(max_model_len=512), _manifest())


def test_every_way_eyrie_starts_vllm_finds_the_projects_own_when_none_is_on_path(monkeypatch):
    """A fresh clone after `make setup`: no `vllm` on PATH, EYRIE_VLLM_COMMAND unset."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("EYRIE_VLLM_COMMAND", raising=False)
    settings = load_settings()
    assert settings.vllm_command == str(ROOT / ".venv-vllm" / "bin" / "python")
    assert vllm_command(settings, _config(), _manifest())[:3] == [settings.vllm_command, "-m", SERVER_MODULE]
    assert serve_env()["VLLM_CPU_KVCACHE_SPACE"] == CPU_KV_CACHE_GIB  # else vLLM's CPU build refuses to start
