"""Plan (or continue) the generate stage of a run: freeze inputs, write the manifest, enqueue.
Run by its planning task (PlanGenerate, first on the generate queue) after its start check at the
edge (the CLI, the API) has checked the dataset at once.

The dataset rows are copied into the store as input shards, so workers on any host need only
Redis and the store, and a rerun reads exactly the rows the first attempt read.
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import orjson

from eyrie.core.config import Settings
from eyrie.core.errors import EyrieError
from eyrie.core.provenance import RUN_CONFIG, as_used, given_by
from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.core.target import check_served, describe, refuse_remote_code
from eyrie.data import dataset
from eyrie.data.manifest import (GenerateParams, Layout, RunManifest, SamplingParams, ShardPlan, TargetRef,
                                 code_version, now_iso)
from eyrie.data.store import Store
from eyrie.runs.reuse import goes_on_to_train, states_to_reuse, train_on_states
from eyrie.stages import GENERATE, PLAN_GENERATE
from eyrie.stages.generate import Generate
from eyrie.stages.run_config import stored_config
from eyrie.stages.start_checks import same_generate, usable_row
from eyrie.tasks.executor import execute
from eyrie.tasks.planner import PlannerTask
from eyrie.work import inference, keys, progress
from eyrie.work.queue import enqueue


def sample_id(ref, row: int) -> str:
    """Deterministic from (the dataset's content or hub commit, split, row): the same row is the same
    sample, wherever the dataset lies."""
    key = f"{ref.revision}|{ref.split}|{row}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def plan_generate(settings: Settings, conn, store: Store, run: str, source: DatasetSection,
                  request: GenerateSettings, trust_remote_code: bool | None = None, given_by: str = RUN_CONFIG,
                  pipeline=None, hub_id: str | None = None) -> tuple[RunManifest, int]:
    """Returns the run manifest and how many tasks were enqueued now. `trust_remote_code`: the
    run config's serve.trust_remote_code (None, without one: whether EYRIE_VLLM_ARGS has the flag).
    `given_by`: who gave `request` (eyrie.core.provenance). `pipeline`: the kept config of a run
    that goes on to train: where an earlier run made its answers and states with the same settings
    as this host resolves them (its EYRIE_<FIELD> defaults included), it trains on those instead."""
    layout = Layout(run)
    if store.exists(layout.manifest):
        manifest = RunManifest.model_validate(store.get_json(layout.manifest))
        same_generate(manifest, source, request)
    else:
        host = settings.generate_defaults()
        planned = request.with_host_defaults(host)
        used = as_used(request, given_by, host)
        earlier = states_to_reuse(store, pipeline, used) if pipeline is not None else None
        if earlier is not None:
            return train_on_states(store, earlier, run), 0
        if trust_remote_code is None:
            trust_remote_code = "--trust-remote-code" in shlex.split(settings.vllm_args)
        manifest = _new_run(settings, conn, store, layout, source, planned, trust_remote_code, used, hub_id)
    conn.sadd(keys.RUNS, run)  # the runs list: no listing of the store
    enqueued = sum(
        enqueue(conn, GENERATE, {"run": run, "shard": plan.index}, plan.index)
        for plan in manifest.generate_shards
        if not store.exists(layout.generate_shard_manifest(plan.index))
    )
    return manifest, enqueued


def _new_run(settings, conn, store, layout, source: DatasetSection, request: GenerateSettings,
             trust_remote_code: bool, used: dict, hub_id: str | None) -> RunManifest:
    ref = dataset.resolve(source.source, source.split, source.revision, source.limit)
    generate = GenerateParams(
        sampling=SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p),
        concurrency=request.concurrency, request_timeout_s=request.request_timeout_s,
        max_retries=request.max_retries, retry_backoff_s=request.retry_backoff_s, shard_size=request.shard_size,
        turns=request.turns)
    usable_row(ref)
    shards, skips = _write_inputs(store, layout, ref, generate.shard_size)
    manifest = RunManifest(run=layout.run, created_at=now_iso(), code_version=code_version(),
                           target=_target(settings, conn, trust_remote_code, hub_id), dataset=ref, generate=generate,
                           generate_shards=shards, input_skips=skips, settings={Generate.own_section(): used})
    store.put_json(layout.manifest, manifest.model_dump())
    progress.reset(conn, layout.run, GENERATE.name)
    return manifest


def _target(settings: Settings, conn, trust_remote_code: bool, hub_id: str | None = None) -> TargetRef:
    """The run's target (settings.model, named by the run config or EYRIE_MODEL). A published
    server must serve that same model, else the run is refused before any request (the stack's
    service, which serves each run's own target in turn, excepted: eyrie.runs.serve_turns). The
    served model taken as the target (`eyrie generate` with none named: eyrie.runs.pipeline.
    stage_config), where this host lacks its directory, is as its server's host described it. One
    that needs its own code is refused here unless the run trusts it (before any request)."""
    endpoint = None if settings.inference_url else inference.read(conn)
    if endpoint and endpoint.model == settings.model and not Path(settings.model).is_dir():
        refuse_remote_code(endpoint.model, trust_remote_code)
        return TargetRef(model=endpoint.model, hub_id=hub_id, revision=endpoint.revision,
                         trust_remote_code=trust_remote_code, chat_template_sha256=endpoint.chat_template_sha256,
                         server=endpoint.server)
    refuse_remote_code(settings.model, trust_remote_code)
    info = describe(settings.model)
    target = TargetRef(model=info.model, hub_id=hub_id, revision=info.revision, chat_template_sha256=info.chat_template_sha256,
                       server=endpoint.server if endpoint else settings.server, conversion=info.conversion,
                       trust_remote_code=trust_remote_code)
    if endpoint and endpoint.run is None:  # the stack's service (`--run active`) serves each run's target in turn
        check_served(target, endpoint)
    return target


def _write_inputs(store, layout, ref, shard_size: int) -> tuple[list[ShardPlan], dict[str, int]]:
    shards, lines, skips, start = [], [], {}, ref.row_start

    def close(end: int) -> None:
        index = len(shards)
        info = store.put_bytes(layout.generate_input(index), b"".join(lines))
        shards.append(ShardPlan(index=index, row_start=start, row_end=end,
                                input_key=info.key, input_sha256=info.sha256))
        lines.clear()

    for row, data, problem in dataset.iter_rows(ref):
        entry = {"row": row, "sample_id": sample_id(ref, row)}
        entry.update({"skip": problem} if problem else {"data": data})
        if problem:
            skips[problem] = skips.get(problem, 0) + 1
        lines.append(orjson.dumps(entry, default=str) + b"\n")
        if len(lines) == shard_size:
            close(row + 1)
            start = row + 1
    if lines:
        close(ref.row_end)
    return shards, skips


class PlanGenerate(PlannerTask):
    """The run's dataset read and cut into input shards in the store, the run manifest written,
    one generate task per shard enqueued; a rerun checks it against its plan and enqueues what is
    missing. A refusal blocks the run (shown by status) until the user starts it again
    (eyrie.tasks.planner). It reads the dataset and the target from the run's kept config too."""

    stage, Request = PLAN_GENERATE, GenerateSettings

    def plan(self, config) -> dict:
        settings = self.settings.model_copy(update={"model": config.target.model})
        pipeline = config if goes_on_to_train(config) else None
        manifest, enqueued = plan_generate(settings, self.conn, self.store, self.run_name, config.dataset,
                                           config.generate, config.serve.trusts_remote_code(),
                                           given_by(config, GENERATE.name), pipeline, config.target.hub_id)
        return {"rows": manifest.dataset.row_end - manifest.dataset.row_start,
                "shards": len(manifest.generate_shards), "enqueued": enqueued, "states_from": manifest.states_from}

    def request(self):
        """The run's kept config: the target, the dataset, the generate settings, how it is served."""
        config = stored_config(self.store, self.run_name)
        if config is None:
            raise EyrieError(f"run {self.run_name}: nothing to plan (no run config kept).",
                             "start it with `eyrie run --config run.yaml` or `eyrie generate --dataset ...`.")
        return config


def run_plan_generate_task(payload: dict) -> dict:
    """RQ entry point (generate queue)."""
    return execute(PlanGenerate, payload)
