"""Plan (or continue) the generate stage of a run: freeze inputs, write the manifest, enqueue.
Run by its planning task (PlanGenerate, first on the generate queue) after `check_dataset` at the
edge (the CLI, the API) has checked the dataset at once.

The dataset rows are copied into the store as input shards, so workers on any host need only
Redis and the store, and a rerun reads exactly the rows the first attempt read.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import orjson

from eyrie.core.config import Settings
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import DatasetSection, GenerateSettings
from eyrie.core.target import check_served, describe
from eyrie.data import dataset
from eyrie.data.manifest import (GenerateParams, Layout, RunManifest, SamplingParams, ShardPlan, TargetRef,
                                 code_version, now_iso)
from eyrie.data.store import Store
from eyrie.runs import pipeline
from eyrie.stages import GENERATE, PLAN_GENERATE
from eyrie.tasks.executor import RunTask, StageTask, execute
from eyrie.work import inference, keys, progress
from eyrie.work.queue import enqueue
from eyrie_generator.prompts import Skip, to_prompt

def sample_id(ref, row: int) -> str:
    """Deterministic from (dataset, revision, split, row): the same row is the same sample."""
    key = f"{ref.source}|{ref.revision}|{ref.split}|{row}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def start_generate(settings: Settings, conn, store: Store, run: str, source: DatasetSection,
                   request: GenerateSettings) -> tuple[RunManifest, int]:
    """Returns the run manifest and how many tasks were enqueued now."""
    layout = Layout(run)
    if store.exists(layout.manifest):
        manifest = RunManifest.model_validate(store.get_json(layout.manifest))
        _check_same(manifest, source, request)
    else:
        planned = request.with_host_defaults(settings.generate_defaults())
        manifest = _new_run(settings, conn, store, layout, source, planned)
    conn.sadd(keys.RUNS, run)  # the runs list: no listing of the store
    enqueued = sum(
        enqueue(conn, GENERATE, {"run": run, "shard": plan.index}, plan.index)
        for plan in manifest.generate_shards
        if not store.exists(layout.generate_shard_manifest(plan.index))
    )
    return manifest, enqueued


def _new_run(settings, conn, store, layout, source: DatasetSection, request: GenerateSettings) -> RunManifest:
    ref = dataset.resolve(source.source, source.split, source.revision, source.limit)
    generate = GenerateParams(
        sampling=SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p),
        concurrency=request.concurrency, request_timeout_s=request.request_timeout_s,
        max_retries=request.max_retries, retry_backoff_s=request.retry_backoff_s, shard_size=request.shard_size)
    _check_usable(ref)
    shards, skips = _write_inputs(store, layout, ref, generate.shard_size)
    manifest = RunManifest(run=layout.run, created_at=now_iso(), code_version=code_version(),
                           target=_target(settings, conn), dataset=ref, generate=generate,
                           generate_shards=shards, input_skips=skips)
    store.put_json(layout.manifest, manifest.model_dump())
    progress.reset(conn, layout.run, GENERATE.name)
    return manifest


def _target(settings: Settings, conn) -> TargetRef:
    """The run's target (settings.model, named by the run config or EYRIE_MODEL). A published
    server must serve that same model, else the run is refused before any request; when no
    target was named (`eyrie generate` on its defaults), the served model is the target."""
    endpoint = None if settings.inference_url else inference.read(conn)
    if endpoint and "model" not in settings.model_fields_set:
        return TargetRef(model=endpoint.model, revision=endpoint.revision,
                         chat_template_sha256=endpoint.chat_template_sha256, server=endpoint.server)
    info = describe(settings.model)
    target = TargetRef(model=info.model, revision=info.revision, chat_template_sha256=info.chat_template_sha256,
                       server=endpoint.server if endpoint else settings.server, conversion=info.conversion)
    if endpoint:
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


def _check_usable(ref) -> None:
    """Refuse a dataset without one usable row (nothing would be generated). Reads up to the first
    usable row: one row for a normal dataset, every row of a broken one."""
    reasons: Counter = Counter()
    for _, data, problem in dataset.iter_rows(ref):
        prompt = None if problem else to_prompt(data)
        if not problem and not isinstance(prompt, Skip):
            return
        reasons[problem or prompt.reason] += 1
    top = ", ".join(f"{reason} x{n}" for reason, n in reasons.most_common(3))
    raise EyrieError(f"dataset {ref.source}: none of the {reasons.total()} rows read is a usable prompt ({top}).",
                     "give rows with `conversations` or `messages`: a list of turns ({from, value} or "
                     "{role, content}) with a human/user turn, one JSON object per line for .jsonl "
                     "(convert a JSON array or CSV to JSON Lines).")


def _check_same(manifest: RunManifest, source: DatasetSection, request: GenerateSettings) -> None:
    """A rerun continues the run; it may not silently change what the run is."""
    ref = manifest.dataset
    wanted = dataset.resolve(source.source, ref.split, None, source.limit)
    problems = []
    if (wanted.source, wanted.revision) != (ref.source, ref.revision):
        problems.append(f"dataset {wanted.source}@{wanted.revision[:12]} vs {ref.source}@{ref.revision[:12]}")
    if source.limit is not None and wanted.row_end != ref.row_end:
        problems.append(f"rows {wanted.row_end} vs {ref.row_end}")
    sampling = manifest.generate.sampling
    for name, value in request.given().items():
        if name in SamplingParams.model_fields and value != getattr(sampling, name):
            problems.append(f"{name} {value} vs {getattr(sampling, name)}")
    if problems:
        raise EyrieError(f"run {manifest.run} already exists with other settings: {'; '.join(problems)}.",
                         "rerun with the original settings to continue it, or choose a new --run name.")


def check_dataset(source: DatasetSection) -> None:
    """At once, where a run is started (the CLI, the API): the dataset is reachable and has a
    usable row; the full read and the shard plan run in the planning task (PlanGenerate)."""
    _check_usable(dataset.resolve(source.source, source.split, source.revision, source.limit))


class PlanGenerateTask(RunTask):
    """The planning task's payload: for a stage started on its own, what to plan (a pipeline's
    planner reads its stored config); `model` when the target was named where it was started."""

    dataset: DatasetSection | None = None
    request: GenerateSettings | None = None
    model: str | None = None


class PlanGenerate(StageTask):
    """The run's dataset read and cut into input shards in the store, the run manifest written,
    one generate task per shard enqueued; a rerun checks it against its plan and enqueues what is
    missing. A refusal blocks the run (shown by status) until the user starts it again. No
    done-check: a plan made already is checked and its missing shards enqueued again."""

    stage = PLAN_GENERATE
    Payload = PlanGenerateTask

    def run(self) -> dict:
        try:
            settings, source, request = self._what_to_plan()
            manifest, enqueued = start_generate(settings, self.conn, self.store, self.run_name, source, request)
        except EyrieError as exc:
            pipeline.block(self.conn, self.run_name, exc)
            return self.result("refused", error=exc.problem, fix=exc.fix)
        return self.result("planned", rows=manifest.dataset.row_end - manifest.dataset.row_start,
                           shards=len(manifest.generate_shards), enqueued=enqueued)

    def _what_to_plan(self):
        payload = self.payload
        if payload.dataset is not None:
            named = {"model": payload.model} if payload.model else {}
            return self.settings.model_copy(update=named), payload.dataset, payload.request or GenerateSettings()
        config = pipeline.stored_config(self.store, self.run_name)
        if config is None:
            raise EyrieError(f"run {self.run_name}: nothing to plan (no pipeline config and no dataset given).",
                             "start it with `eyrie run --config run.yaml` or `eyrie generate --dataset ...`.")
        return self.settings.model_copy(update={"model": config.target.model}), config.dataset, config.generate


def run_plan_generate_task(payload: dict) -> dict:
    """RQ entry point (generate queue)."""
    return execute(PlanGenerate, payload)
