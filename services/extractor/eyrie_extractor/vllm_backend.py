"""Hidden states from a running vLLM server, for targets only vLLM can run (e.g. a 1T-parameter MoE).

vLLM's `extract_hidden_states` speculative method keeps, for every prompt token, the hidden states
at the layer ids of `eagle_aux_hidden_state_layer_ids` (id i: the input of decoder layer i;
num_layers: the last layer's output, before the final norm: the same convention as HFCapture).
Its `ExampleHiddenStatesConnector` writes them, once the request finishes, to
`{shared_storage_path}/{request_id}.safetensors` (`hidden_states [seq, n_ids, H]` in the model's
dtype, `token_ids [seq]`), guarded by a `.lock` file it holds while writing, and returns the path in
the Completions response: `kv_transfer_params["hidden_states_path"]`.

`extract_command` builds the server's command line as speculators' launcher does;
`VllmCapture` is a drop-in for `capture.HFCapture`: one Completions request per sequence
(`prompt` = the token ids, `max_tokens` = 1, `return_token_ids`, as speculators'
`generate-offline-data` sends), the file read, checked, deleted, and the batch stacked.
The server's `shared_dir` must be visible to the extractor at the same path (same host, or the
same volume mounted at the same path).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.layers import resolve_aux_layers
from eyrie.core.vllm import serve_argv
from eyrie_extractor.plan import target_shape

CONNECTOR = "ExampleHiddenStatesConnector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"  # ours, for vLLM's CPU build (eyrie_extractor.vllm_cpu_connector)
CPU_CONNECTOR_MODULE = "eyrie_extractor.vllm_cpu_connector"
CPU_CONNECTOR_PATH = str(Path(__file__).resolve().parent.parent)  # on vLLM's PYTHONPATH where it is used


class VllmCaptureError(RuntimeError):
    """The server's answer or its hidden-states file is not what this batch needs."""


def vllm_layer_ids(aux_layers: Sequence[int], num_layers: int) -> list[int]:
    """The ids the server is started with: the aux layers plus the last layer's output,
    distinct and ascending (vLLM stacks them in forward order, whatever order the config lists)."""
    return sorted(set(aux_layers) | {num_layers})


def speculative_config(aux_layers: Sequence[int], num_layers: int) -> dict:
    # As speculators' scripts/launch_vllm.py (vllm-project/speculators) builds it.
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(aux_layers, num_layers)}}}


def kv_transfer_config(shared_dir: str | Path, cpu: bool = False) -> dict:
    """hs-connectors' `file` backend, as speculators' launcher takes it from the registry; the
    launcher's own inline copy where hs-connectors is not installed (e.g. the vLLM image).
    `cpu`: our subclass of the connector, for vLLM's CPU build, where the stock one fails."""
    if cpu:
        return {"kv_connector": CPU_CONNECTOR, "kv_connector_module_path": CPU_CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)}}
    try:
        from argparse import Namespace

        from hs_connectors.transfer import FileBackend

        return FileBackend.build_kv_transfer_config(Namespace(hidden_states_path=str(shared_dir)))
    except ImportError:
        return {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)}}


def extract_command(model: str, aux_layers: Sequence[int], shared_dir: str | Path,
                    tensor_parallel_size: int = 1, port: int = 8000,
                    extra_args: str | Sequence[str] = (), *, num_layers: int | None = None,
                    host: str = "127.0.0.1", vllm_command: str = "vllm", cpu: bool = False) -> list[str]:
    """The real `vllm serve` command line of an extraction server.

    Mirrors speculators' scripts/launch_vllm.py (vllm-project/speculators; its `file` backend is
    hs_connectors/transfer.py FileBackend.build_kv_transfer_config): `--speculative-config` with
    method `extract_hidden_states` and the aux layer ids plus the last layer (its
    `--include-last-layer` default), `--kv-transfer-config` with ExampleHiddenStatesConnector
    writing to `shared_dir` (with `cpu`, our CpuHiddenStatesConnector: its process then needs
    CPU_CONNECTOR_PATH on PYTHONPATH). `vllm_command`: as EYRIE_VLLM_COMMAND (eyrie.core.vllm). Its front-end defaults (`--api-server-count 4
    --renderer-num-workers 2`) are left out: they serve chat-template rendering, and eyrie sends
    token ids. `num_layers` is read from the model's config when not given (as the launcher does).
    """
    extra = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
    if num_layers is None:  # the target's own code is trusted here exactly where vLLM is told to trust it
        num_layers, _ = target_shape(model, "--trust-remote-code" in extra)
    aux = resolve_aux_layers(list(aux_layers), num_layers)  # distinct, within [0, num_layers]
    return [*serve_argv(vllm_command, model), "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(tensor_parallel_size),
            "--speculative-config", json.dumps(speculative_config(aux, num_layers)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(shared_dir, cpu)), *extra]


def clear_orphans(shared_dir: str | Path) -> int:
    """Before vLLM starts: the files an earlier vLLM process left in its shared directory. Each
    answered a request that died with that process (an outage, a crash); no reader will ever
    ask for them. Returns how many were deleted."""
    folder = Path(shared_dir)
    orphans = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    for path in orphans:
        path.unlink(missing_ok=True)
    return len(orphans)


def connector_env(env: dict | None = None) -> dict:
    """The environment of a vLLM that loads CpuHiddenStatesConnector: this package on its path."""
    import os

    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [CPU_CONNECTOR_PATH, env.get("PYTHONPATH")]))
    return env


def _mismatch(sent: list[int], got: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
    at = lambda ids: ids[first] if first < len(ids) else "end"  # noqa: E731
    return (f"sent {len(sent)} ids, got {len(got)}; first difference at position {first} "
            f"(sent {at(sent)}, got {at(got)}); sent[{first}:{first + 8}]={sent[first:first + 8]}, "
            f"got[{first}:{first + 8}]={got[first:first + 8]}")


class VllmCapture:
    """Same interface as HFCapture: `forward(input_ids) -> [batch, max_len, n_aux + 1, H]` on the
    host, right-padded (padding rows are zeros; the caller slices each sequence to its length)."""

    def __init__(self, endpoint_url: str, model: str, aux_layers: list[int], num_layers: int,
                 hidden_size: int, timeout_s: float = 1800.0, *, max_retries: int = 3,
                 concurrency: int = 64):
        from openai import OpenAI
        # speculators' client (importable without vLLM): its retry policy (2, 4, 8 s; never on
        # InvalidResponseError) and its reading of the response (prompt_token_ids, handle).
        from speculators.data_generation.vllm_client import InvalidResponseError, extract_output, with_retries

        self.endpoint_url = endpoint_url.rstrip("/")
        base = self.endpoint_url if self.endpoint_url.endswith("/v1") else f"{self.endpoint_url}/v1"
        self.client = OpenAI(base_url=base, api_key="EMPTY", max_retries=0, timeout=timeout_s)
        self.model, self.aux_layers = model, list(aux_layers)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.layer_ids = vllm_layer_ids(aux_layers, num_layers)  # what the server must be started with
        self._columns = [self.layer_ids.index(i) for i in [*self.aux_layers, num_layers]]
        self._identity = self._columns == list(range(len(self.layer_ids)))
        self._invalid, self._extract_output = InvalidResponseError, extract_output
        self._request = with_retries(self._request_once)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vllm-capture")

    def forward(self, input_ids: list[list[int]]) -> torch.Tensor:
        """One request per sequence, all in flight together; every file is deleted, even when
        another sequence of the batch fails (the first failure is raised once all are done)."""
        futures = [self._pool.submit(self._one, row, [int(t) for t in ids])
                   for row, ids in enumerate(input_ids)]
        wait(futures)
        states = [f.result() for f in futures]  # raises the first failure, in batch order
        longest = max((len(s) for s in states), default=0)
        dtype = states[0].dtype if states else torch.bfloat16
        out = torch.zeros(len(states), longest, len(self._columns), self.hidden_size, dtype=dtype)
        for row, s in enumerate(states):
            out[row, : len(s)] = s
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()

    def _one(self, row: int, ids: list[int]) -> torch.Tensor:
        where = f"vLLM at {self.endpoint_url}, sequence {row} of the batch ({len(ids)} tokens)"
        try:
            handle, problem = self._request(ids, max_retries=self.max_retries)
        except self._invalid as exc:
            hint = ("; was the server started with extract_command (speculative method "
                    f"extract_hidden_states, {CONNECTOR})?") if "kv_transfer_params" in str(exc) else ""
            raise VllmCaptureError(f"{where}: {exc}{hint}") from None
        except Exception as exc:
            raise VllmCaptureError(f"{where}: the request failed after {self.max_retries + 1} attempts: "
                                   f"{type(exc).__name__}: {exc}") from exc
        try:  # the file is read (its lock waited for) and deleted even when the answer is wrong
            data = self._load(handle, where)
        except VllmCaptureError:
            if problem:
                raise VllmCaptureError(f"{where}: {problem}") from None
            raise
        finally:
            for path in (Path(handle), Path(f"{handle}.lock")):
                path.unlink(missing_ok=True)
        if problem:
            raise VllmCaptureError(f"{where}: {problem}")
        return self._check(data, ids, handle, where)

    def _request_once(self, ids: list[int]) -> tuple[str, str | None]:
        """The request of speculators' generate_hidden_states (data_generation/vllm_client.py),
        its response read by speculators' extract_output. A prompt-id mismatch comes back as a
        problem beside the handle, so that the file the server wrote anyway is still deleted."""
        res = self.client.completions.create(model=self.model, prompt=ids, max_tokens=1,
                                             extra_body={"return_token_ids": True}, timeout=self.timeout_s)
        got = getattr(res.choices[0], "prompt_token_ids", None) if res.choices else None
        params = getattr(res, "kv_transfer_params", None) or {}
        handle = params.get("hidden_states_path") or params.get("handle")
        if got is not None and handle and list(got) != ids:
            return handle, ("the response's prompt_token_ids differ from the ids sent: "
                            f"{_mismatch(ids, list(got))}")
        handle, _ = self._extract_output(res, ids)  # raises InvalidResponseError on a missing field
        return handle, None

    def _load(self, handle: str, where: str) -> dict[str, torch.Tensor]:
        """hs_connectors' FileTransfer.get_generated (transfer.py `_load_hs_file`), with the lock
        wait bounded by timeout_s instead of its fixed 10 s (a large sequence takes longer to write)."""
        from hs_connectors.transfer import wait_for_lock
        from safetensors.torch import load_file

        lock = Path(f"{handle}.lock")
        if lock.exists():
            try:
                wait_for_lock(str(lock), timeout=self.timeout_s)
            except FileNotFoundError:  # released and removed in between
                pass
        if not Path(handle).exists():
            if not self._server_alive():
                raise VllmCaptureError(
                    f"{where}: the server answered with {handle}, then stopped answering before the file "
                    "appeared: its engine died after answering. Read the server's log (its last error) "
                    "and restart it; on vLLM's CPU build start it with extract_command(..., cpu=True).")
            raise VllmCaptureError(f"{where}: the server wrote {handle}, which this host cannot read; "
                                   "mount the server's shared_dir at the same path here.")
        return load_file(handle)

    def _server_alive(self) -> bool:
        """vLLM's /health answers 200 while its engine runs (503 or nothing once it has died)."""
        import requests

        try:
            return requests.get(f"{self.endpoint_url.removesuffix('/v1')}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def _check(self, data: dict[str, torch.Tensor], ids: list[int], handle: str, where: str) -> torch.Tensor:
        missing = {"hidden_states", "token_ids"} - data.keys()
        if missing:
            raise VllmCaptureError(f"{where}: {handle} lacks {sorted(missing)} (has {sorted(data)}).")
        got = data["token_ids"].tolist()
        if got != ids:
            raise VllmCaptureError(f"{where}: the token ids in {handle} differ from the ids sent: "
                                   f"{_mismatch(ids, got)}")
        states = data["hidden_states"]
        expected = [len(ids), len(self.layer_ids), self.hidden_size]
        if list(states.shape) != expected:
            raise VllmCaptureError(
                f"{where}: hidden_states in {handle} has shape {list(states.shape)}, expected {expected} "
                f"= [seq, layer ids {self.layer_ids}, hidden size]; start the server with "
                "extract_command for this target and these layers.")
        return states if self._identity else states[:, self._columns]


def main(argv: list[str] | None = None) -> int:
    """Print (or run) the extraction server's command line:
    python -m eyrie_extractor.vllm_backend MODEL --layers 2,30,58 --shared-dir DIR [-- VLLM_ARGS]"""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m eyrie_extractor.vllm_backend", description=main.__doc__)
    parser.add_argument("model")
    parser.add_argument("--layers", required=True, help="aux layer ids, e.g. 2,30,58 (as `eyrie extract`)")
    parser.add_argument("--shared-dir", required=True, help="where vLLM writes; the extractor reads there")
    parser.add_argument("--num-layers", type=int, help="the target's decoder layers (default: its config)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--vllm-command", help="the vllm executable or a Python with vLLM (default: "
                                               "EYRIE_VLLM_COMMAND, else `vllm` on PATH, else the project's .venv-vllm)")
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU build: use eyrie's CPU-safe connector")
    parser.add_argument("--exec", action="store_true", help="run it instead of printing it")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    try:
        vllm_command = args.vllm_command or load_settings().vllm_command
    except EyrieError as exc:
        print(f"eyrie: {exc}", file=sys.stderr)
        return 2
    cmd = extract_command(args.model, [int(x) for x in args.layers.split(",")], args.shared_dir,
                          args.tensor_parallel_size, args.port, extra, num_layers=args.num_layers,
                          host=args.host, vllm_command=vllm_command, cpu=args.cpu)
    if args.exec:
        Path(args.shared_dir).mkdir(parents=True, exist_ok=True)
        os.execvpe(cmd[0], cmd, connector_env() if args.cpu else dict(os.environ))
    print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
