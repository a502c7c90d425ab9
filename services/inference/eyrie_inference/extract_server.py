"""`eyrie serve-extract`: the stack's vLLM extraction server. It waits for a pipeline whose extract
stage runs on the vLLM backend, takes the GPU lease (once inference has handed it over), serves the
run's target with `extract_hidden_states` (its serve section: TP, PP, trust_remote_code, ...; the
run's layers; the shared directory the extractor reads) and publishes itself. An offline run needs
it until every shard is extracted; a hybrid or online run (extract.storage) until its drafter is
trained, since the trainer asks it for the hidden states not stored (an online run's extract stage
needs none, its training does: it is started for a run already extracted too). Then, or once the
run can no longer use it (the stage reading it failed for good, the run blocked, cancelled or no
longer active: within Server.RELEASE_S, as the inference server), it stops vLLM and hands the GPUs
back (to the trainer, after an offline run); while it waits for the GPUs, it stops waiting. For a
hybrid or online run it leases the GPUs in "share" mode and starts vLLM at the
--gpu-memory-utilization the plan names for it, so that the run's trainer may train on one of them
beside it (eyrie.work.gpu; `eyrie run --plan` refuses where the trainer cannot fit there)."""

from __future__ import annotations

import time
from pathlib import Path

from eyrie.core.budget import human
from eyrie.core.errors import EyrieError
from eyrie.core.storage import trains_on_demand
from eyrie.core.vllm import on_cpu, serve_env
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.runs.pipeline import can_go_on
from eyrie.runs.projection import project
from eyrie.runs.storage_plan import vllm_utilization
from eyrie.stages import EXTRACT, PIPELINE, TRAIN, PipelineStage
from eyrie.stages.run_config import stored_config
from eyrie.work import inference, keys
from eyrie_extractor.vllm_backend import clear_orphans, connector_env, extract_command
from eyrie_inference.server import Server

UTILIZATION = "--gpu-memory-utilization"


def extraction_run(conn, store) -> str | None:
    """An active pipeline on the vLLM backend that needs the server now (needs_server) and can use
    it: one whose stage reading it failed for good, or that is blocked or cancelled, holds no
    server (and no GPUs) until `eyrie retry` or a rerun (can_go_on)."""
    for run in sorted(m.decode() for m in conn.smembers(keys.ACTIVE_PIPELINES)):
        try:
            manifest = load_run_manifest(store, run)
        except EyrieError:
            continue
        if manifest.extract and manifest.extract.backend == "vllm" and needs_server(store, manifest) \
                and can_go_on(conn, store, run, reading_stage(store, manifest)):
            return run
    return None


def reading_stage(store, manifest) -> PipelineStage:
    """The stage that reads the server now: extract until every shard is extracted, then the
    training of a run that trains on demand."""
    work = TRAIN if extracted(store, manifest) else EXTRACT
    return next(s for s in PIPELINE if s.work is work)


def needs_server(store, manifest) -> bool:
    """offline: until every shard is extracted; hybrid and online: until the drafter is trained."""
    if trains_on_demand(manifest):
        return not trained(store, manifest)
    return not extracted(store, manifest)


def extracted(store, manifest) -> bool:
    layout = Layout(manifest.run)
    return all(store.exists(layout.extract_shard_manifest(p.index)) for p in manifest.generate_shards)


def trained(store, manifest) -> bool:
    """The run manifest's drafter record: the stage's own proof that it is done (the train stage's
    `done`), read fresh."""
    return load_run_manifest(store, manifest.run).drafter is not None


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


def sharing_utilization(settings, config) -> tuple[float | None, str]:
    """vLLM's --gpu-memory-utilization for a run training on demand: the plan's highest at which the
    service still fits and leaves the trainer room on a GPU they share (storage_plan.gpu_sharing),
    unless serve.extra_args sets a lower one; and why. None: vLLM keeps its own."""
    if on_cpu():
        return None, "vLLM's CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE, not by a share of a GPU"
    try:
        g = project(config, settings, measure=False).storage.gpu_sharing
    except EyrieError as exc:
        return None, f"the plan could not size the GPUs' memory ({exc})"
    most, asked = g.utilization_for_both, vllm_utilization(config.serve.extra_args)
    if most is None:
        return None, (f"the trainer ({human(g.trainer.total)}) fits beside the service "
                      f"({human(g.service.total)} a GPU) at no utilization of {human(g.gpu_bytes)} "
                      f"({g.gpu_memory_from}): it needs a GPU of its own")
    if asked <= most:
        return None, f"its {asked:.2f} (serve.extra_args or vLLM's default) leaves the trainer room (at most {most:.2f})"
    return most, (f"the highest share at which the service ({human(g.service.total)} a GPU) fits and "
                  f"leaves the trainer ({human(g.trainer.total)}) room on a GPU of {human(g.gpu_bytes)} "
                  f"({g.gpu_memory_from}) they share; {asked:.2f} would leave {human((1 - asked) * g.gpu_bytes)}")


def with_utilization(cmd: list[str], share: float) -> list[str]:
    """`cmd` with --gpu-memory-utilization `share` in place of any it had."""
    kept = [a for i, a in enumerate(cmd) if a != UTILIZATION and not a.startswith(UTILIZATION + "=")
            and not (i > 0 and cmd[i - 1] == UTILIZATION)]
    return [*kept, UTILIZATION, f"{share:.2f}"]


class ExtractServer(Server):
    OWNER = "extract-server"

    def __init__(self, settings, conn, store, run: str):
        self.store, self.run_name = store, run
        self._said_training = False
        self.config, self.manifest = stored_config(store, run), load_run_manifest(store, run)
        settings = settings.model_copy(update={"server": "vllm", "endpoint_name": "extract"})
        super().__init__(settings, conn, self.config.target.model, self.config.serve, run)

    def command(self) -> list[str]:
        Path(self.settings.extract_shared_dir).mkdir(parents=True, exist_ok=True)
        clear_orphans(self.settings.extract_shared_dir)
        cmd = vllm_command(self.settings, self.config, self.manifest)
        if not trains_on_demand(self.manifest):
            return cmd
        share, why = sharing_utilization(self.settings, self.config)
        chose = f"{UTILIZATION} {share:.2f}" if share is not None else f"vLLM keeps its {UTILIZATION}"
        print(f"eyrie serve-extract: run {self.run_name} trains beside this server: {chose}: {why}", flush=True)
        return cmd if share is None else with_utilization(cmd, share)

    def gpu_mode(self) -> str:
        """A run training on demand: its trainer may hold one of these GPUs beside vLLM."""
        return "share" if trains_on_demand(self.manifest) else "own"

    def env(self) -> dict[str, str]:
        """On the CPU, vLLM loads our CPU-safe connector (eyrie_extractor.vllm_cpu_connector)."""
        return connector_env(serve_env()) if on_cpu() else serve_env()

    def _wait_turn(self) -> None:
        pass  # started for a run that extracts, or trains on demand, now

    def _drained(self) -> bool:
        """Done: the run no longer needs the server (needs_server), or can no longer use it (can_go_on:
        the stage reading it failed for good, or the run is blocked, cancelled or no longer active);
        seen at the next poll (Server.POLL_S), then vLLM is stopped: the GPUs are free within
        Server.RELEASE_S."""
        run = self.run_name
        reading = reading_stage(self.store, self.manifest)
        # asked before needs_server, which reads the same proofs the stage's `done` reads: a run that
        # finishes between the two reads is then seen finished, not as one that can no longer go on
        goes_on = can_go_on(self.conn, self.store, run, reading)
        if not needs_server(self.store, self.manifest):
            return self._done(f"run {run} is trained" if trains_on_demand(self.manifest) else f"run {run} is extracted")
        if not goes_on:
            return self._done(f"run {run} can no longer use it (its {reading.name} failed for good, or it is "
                              "blocked, cancelled or no longer active)")
        if self.proc is not None and not self._said_training:
            self._say_when_training()
        return False

    _given_up = _drained  # asked while it waits for the GPUs too (Server._acquire_gpus)

    def _say_when_training(self) -> None:
        if trains_on_demand(self.manifest) and extracted(self.store, self.manifest):
            self._said_training = True
            print(f"eyrie serve-extract: run {self.run_name} is extracted and trains on hidden states this server "
                  f"makes (extract.storage {self.manifest.extract.storage}): serving until its drafter is trained",
                  flush=True)

    def _done(self, why: str) -> bool:
        if self.proc is not None:
            print(f"eyrie serve-extract: {why}: stopping vLLM and handing over the GPUs", flush=True)
        return True

    def _publish(self, state: str, progress: str | None = None) -> None:
        self.endpoint.state = state
        if progress is not None:
            self.endpoint.progress = progress
        inference.publish_extract(self.conn, self.endpoint)


def serve_extract(settings, conn, store, once: bool = False, poll_s: float = 5.0) -> int:
    """Serve each run that needs the server in turn (or one, with `once`); holds no GPU while it waits."""
    while True:
        run = extraction_run(conn, store)
        if run is None:
            time.sleep(poll_s)
            continue
        print(f"eyrie serve-extract: {serving_for(store, run)}", flush=True)
        code = ExtractServer(settings, conn, store, run).run()
        if once or code:
            return code


def serving_for(store, run: str) -> str:
    manifest = load_run_manifest(store, run)
    if trains_on_demand(manifest) and extracted(store, manifest):
        return f"run {run} trains on hidden states made on vLLM (extract.storage {manifest.extract.storage})"
    return f"run {run} extracts on vLLM"
