"""`eyrie serve-extract`: the stack's vLLM extraction server. It waits for a pipeline whose extract
stage runs on the vLLM backend, takes the GPU lease (once inference has handed it over), serves the
run's target with `extract_hidden_states` (its serve section: TP, PP, trust_remote_code, ...; the
run's layers; the shared directory the extractor reads), publishes itself for the extractor, and
stops and hands the GPUs back once every shard is extracted (then the trainer takes them)."""

from __future__ import annotations

import time
from pathlib import Path

from eyrie.core.errors import EyrieError
from eyrie.core.vllm import on_cpu, serve_env
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.runs.pipeline import stored_config
from eyrie.work import inference, keys
from eyrie_extractor.vllm_backend import connector_env, extract_command
from eyrie_inference.server import Server


def extraction_run(conn, store) -> str | None:
    """An active pipeline whose extract stage is planned on the vLLM backend and not done."""
    for run in sorted(m.decode() for m in conn.smembers(keys.ACTIVE_PIPELINES)):
        try:
            manifest = load_run_manifest(store, run)
        except EyrieError:
            continue
        if manifest.extract and manifest.extract.backend == "vllm" and not extracted(store, manifest):
            return run
    return None


def extracted(store, manifest) -> bool:
    layout = Layout(manifest.run)
    return all(store.exists(layout.extract_shard_manifest(p.index)) for p in manifest.generate_shards)


def vllm_command(settings, cfg, manifest) -> list[str]:
    """extract_command for the run: its layers, its serve section, the shared directory."""
    serve, params = cfg.serve, manifest.extract
    if serve.max_model_len and params.max_length and serve.max_model_len < params.max_length + 1:
        raise EyrieError(f"serve.max_model_len {serve.max_model_len} is below extract.max_length + 1 "
                         f"({params.max_length + 1}): vLLM would refuse the longest samples.",
                         f"set serve.max_model_len to at least {params.max_length + 1}.")
    extra = serve.vllm_flags()[2:]  # after --tensor-parallel-size N, which extract_command sets
    # the target as the run recorded it (a local path made absolute): the name the extractor asks vLLM for
    return extract_command(manifest.target.model, params.aux_layers, settings.extract_shared_dir,
                           serve.tensor_parallel_size, settings.port, extra, num_layers=params.num_layers,
                           host=settings.host, vllm_command=settings.vllm_command, cpu=on_cpu())


class ExtractServer(Server):
    OWNER = "extract-server"

    def __init__(self, settings, conn, store, run: str):
        self.store, self.run_name = store, run
        self.config, self.manifest = stored_config(store, run), load_run_manifest(store, run)
        settings = settings.model_copy(update={"server": "vllm", "endpoint_name": "extract"})
        super().__init__(settings, conn, self.config.target.model, self.config.serve)

    def command(self) -> list[str]:
        Path(self.settings.extract_shared_dir).mkdir(parents=True, exist_ok=True)
        return vllm_command(self.settings, self.config, self.manifest)

    def env(self) -> dict[str, str]:
        """On the CPU, vLLM loads our CPU-safe connector (eyrie_extractor.vllm_cpu_connector)."""
        return connector_env(serve_env()) if on_cpu() else serve_env()

    def _wait_turn(self) -> None:
        pass  # started for a run that is extracting now

    def _drained(self) -> bool:
        """Done: every shard extracted, or the run cancelled or no longer active."""
        done = extracted(self.store, self.manifest) or self.conn.exists(keys.cancelled(self.run_name)) \
            or not self.conn.sismember(keys.ACTIVE_PIPELINES, self.run_name)
        if done and self.proc is not None:
            print(f"eyrie serve-extract: run {self.run_name} is extracted: stopping vLLM and handing over "
                  "the GPUs", flush=True)
        return bool(done)

    def _publish(self, state: str) -> None:
        self.endpoint.state = state
        inference.publish_extract(self.conn, self.endpoint)


def serve_extract(settings, conn, store, once: bool = False, poll_s: float = 5.0) -> int:
    """Serve each run's extraction in turn (or one, with `once`); holds no GPU while it waits."""
    while True:
        run = extraction_run(conn, store)
        if run is None:
            time.sleep(poll_s)
            continue
        print(f"eyrie serve-extract: run {run} extracts on vLLM", flush=True)
        code = ExtractServer(settings, conn, store, run).run()
        if once or code:
            return code
