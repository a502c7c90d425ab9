"""One pipeline per run: the config `eyrie run` takes, kept in the store, and `advance`, which
starts each stage by itself once the one before is done (called when any task finishes, and by
`eyrie run` itself; every start is idempotent, so calling it twice does nothing twice)."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from eyrie import keys, progress
from eyrie.errors import EyrieError
from eyrie.k8s_jobs import load_templates
from eyrie.config import load_settings
from eyrie.manifest import RUN_NAME, Layout, check_run_name, load_run_manifest
from eyrie.queue import enqueue, job_state, live_tasks, workers_on
from eyrie.section import Section as _Section
from eyrie.stages import EXTRACT, FETCH, GENERATE, PLAN_EXTRACT, TRAIN, VERIFY, entry
from eyrie.stage_settings import DatasetSection, ExtractSettings, GenerateSettings, TrainSettings
from eyrie.store import open_store

log = logging.getLogger("eyrie.pipeline")


class TargetShape(_Section):
    """For `--plan` where the target's config cannot be read (no hub access): its shape."""

    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    architecture: str | None = Field(None, min_length=1, description="config.json's architectures[0].")


class TargetSection(_Section):
    model: str = Field(min_length=1, description="Local directory or HF id of the target.")
    shape: TargetShape | None = None


class ServeSection(_Section):
    """How the target is served (vLLM flags): part of the run, not of the host's .env."""

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    reasoning_parser: str | None = Field(None, min_length=1, description="e.g. kimi_k2, deepseek_r1, qwen3.")
    trust_remote_code: bool = False
    max_model_len: int | None = Field(None, ge=16)
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags, one per item.")

    def vllm_flags(self) -> list[str]:
        flags = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            flags += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.reasoning_parser:
            flags += ["--reasoning-parser", self.reasoning_parser]
        if self.max_model_len:
            flags += ["--max-model-len", str(self.max_model_len)]
        if self.trust_remote_code:
            flags.append("--trust-remote-code")
        return flags + list(self.extra_args)

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class VerifySection(_Section):
    """The exported drafter served by vLLM (`eyrie verify`) after export, on the run's held-out
    prompts and on any benchmark sets named here. `enabled` None: wherever vLLM can run
    (EYRIE_VLLM_COMMAND names an executable or Python that exists)."""

    enabled: bool | None = None
    benchmarks: list[str] = Field(default_factory=list, json_schema_extra={"flag": "bench"},
                                  description="Prompt sets measured beside the held-out prompts: mt-bench, "
                                              "gsm8k, humaneval, or a .jsonl file.")
    ks: list[int] = Field(default_factory=list, json_schema_extra={"flag": "k"},
                          description="Draft lengths K to serve the drafter with (empty: the K it was trained for).")
    prompts: int | None = Field(None, ge=1, description="At most this many prompts per set (held-out included; "
                                                       "file order).")
    max_tokens: int | None = Field(None, ge=1, description="Answer length (unset: generate.max_tokens).")
    serial_prompts: int = Field(8, ge=1, description="Prompts answered one at a time for tokens/s at 1 in flight.")

    @field_validator("benchmarks", "ks", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [part.strip() for part in v.split(",") if part.strip()] if isinstance(v, str) else v

    @field_validator("benchmarks")
    @classmethod
    def _each_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):  # each set is one entry of the result: a repeat would hide a measurement
            raise ValueError("name each benchmark once")
        return v

    @field_validator("ks")
    @classmethod
    def _draft_lengths(cls, v: list[int]) -> list[int]:
        if any(not 1 <= k <= 16 for k in v) or len(set(v)) != len(v):
            raise ValueError("each K once, between 1 and 16 (e.g. 3,5)")
        return v


class PlanSection(_Section):
    """Figures only `--plan` reads: what to expect, where it is not known before the run."""

    mean_tokens: int | None = Field(None, ge=1, description="Expected mean sample length, prompt + completion.")
    generate_tokens_per_s: float | None = Field(None, gt=0, description="The server's output tok/s at C.")
    extract_tokens_per_s: float | None = Field(None, gt=0, description="Else our benchmark's figure for the shape.")
    train_tokens_per_s: float | None = Field(None, gt=0, description="Else our benchmark's figure for the shape.")
    store_path: str | None = Field(None, description="Local directory behind the bucket (MinIO's data dir).")
    trainer_cache_path: str | None = Field(None, description="Where the trainer keeps its copy (EYRIE_CACHE_DIR).")


class RunConfig(_Section):
    """What `eyrie run --config run.yaml` runs: every stage, from prompts to an exported drafter."""

    run: str = Field(pattern=RUN_NAME.pattern, description="1-64 letters, digits, '.', '_' or '-'.")
    target: TargetSection
    dataset: DatasetSection
    serve: ServeSection = Field(default_factory=ServeSection)
    generate: GenerateSettings = Field(default_factory=GenerateSettings)
    extract: ExtractSettings = Field(default_factory=ExtractSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    verify: VerifySection = Field(default_factory=VerifySection)
    plan: PlanSection = Field(default_factory=PlanSection)


def load_config(path: Path) -> RunConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise EyrieError(f"no config file {path}.", "pass the path of a run.yaml (examples/ has two).") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, a name too long, not UTF-8
        raise EyrieError(f"cannot read config {str(path)[:120]!r} ({getattr(exc, 'strerror', None) or exc}).",
                         "pass the path of a run.yaml file (UTF-8 text; examples/ has two).") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise EyrieError(f"{path} is not valid YAML ({' '.join(str(exc).split())[:200]}).",
                         "fix the YAML syntax.") from None
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise EyrieError(f"{path}: {fields}.", "correct these fields (README: `eyrie run`).") from None
    check_run_name(config.run)
    return with_absolute_target(config)


def with_absolute_target(config: RunConfig) -> RunConfig:
    """A target directory named relative to where `eyrie run` reads the config, made absolute: the
    stored config then names it for every service that mounts it there (the server, the verifier),
    whatever their working directory."""
    model = Path(config.target.model)
    if model.is_absolute() or not model.is_dir():
        return config
    return config.model_copy(update={"target": config.target.model_copy(update={"model": str(model.resolve())})})


def config_key(run: str) -> str:
    return f"{Layout(run).root}/pipeline.json"


def save_config(conn, store, config: RunConfig) -> None:
    """The run's config is kept; a rerun continues the run and may change only the sections of
    stages not yet planned (e.g. extract.budget after a refusal)."""
    key = config_key(config.run)
    if store.exists(key):
        kept = RunConfig.model_validate(store.get_json(key))
        changed = sorted(k for k in RunConfig.model_fields if getattr(kept, k) != getattr(config, k))
        frozen = [k for k in changed if k not in _open_sections(store, config.run)]
        if frozen:
            raise EyrieError(f"run {config.run} was started with another config (differs in: {', '.join(frozen)}, "
                             "of stages already planned).",
                             "rerun with the original config to continue it, or give the new one another run name.")
    store.put_json(key, config.model_dump())
    conn.sadd(keys.ACTIVE_PIPELINES, config.run)


def _open_sections(store, run: str) -> set[str]:
    if not store.exists(Layout(run).manifest):
        return set(RunConfig.model_fields)
    manifest = load_run_manifest(store, run)
    # how the target is served changes nothing the run records (a restart with more GPUs, say)
    return {"serve", "plan"} | {name for name, planned in (("extract", manifest.extract), ("train", manifest.train),
                                                           ("verify", manifest.verify)) if planned is None}


def stored_config(store, run: str) -> RunConfig | None:
    key = config_key(run)
    return RunConfig.model_validate(store.get_json(key)) if store.exists(key) else None


def advance(conn, store, run: str) -> str | None:
    """Start the next stage of the run's pipeline if the one before is done; returns its name."""
    config = stored_config(store, run)
    if config is None:
        return None
    with conn.lock(keys.advance_lock(run), timeout=300, blocking_timeout=300):
        return _next_stage(conn, store, config)


def _next_stage(conn, store, config: RunConfig) -> str | None:
    manifest, layout = load_run_manifest(store, config.run), Layout(config.run)
    if not all(store.exists(layout.generate_shard_manifest(p.index)) for p in manifest.generate_shards):
        return None
    if manifest.extract is None:  # planned by the extractor (it has the tokenizer and the model config)
        enqueue(conn, PLAN_EXTRACT, {"run": config.run})
        return "extract"
    if not _all_extracted(store, manifest, layout):
        start_extract(conn, store, config.run, config.extract)  # planned: this only enqueues what is missing
        return "extract"
    if manifest.drafter is None:
        # planned by the trainer (which fetches and checks the base drafter in its own cache)
        enqueue(conn, TRAIN, {"run": config.run, "request": config.train.model_dump()})  # the settings given
        return "train"
    if manifest.verify is None:
        skipped = verify_skipped(conn, config)
        if skipped is None:
            enqueue(conn, VERIFY, {"run": config.run}, timeout_s=verify_timeout_s(conn, config, manifest))
            return "verify"
        manifest.verify = skipped  # never skipped in silence: the run's status says why and how
        store.put_json(layout.manifest, manifest.model_dump())
    conn.srem(keys.ACTIVE_PIPELINES, config.run)  # exported (and verified): the pipeline is done
    return None


MIN_VERIFY_TOK_S = 5.0  # tokens/s: a floor where generation measured nothing (e.g. a stub server)
BENCHMARK_PROMPTS_BOUND = 1319  # the largest shipped benchmark (GSM8K test)


def generate_tok_s(conn, run: str) -> float | None:
    """Completion tokens per second over the run's generate stage, as its progress recorded it."""
    entries = progress.read(conn, run, GENERATE.name).values()
    started = progress.started_at(conn, run, GENERATE.name)
    tokens, last = sum(e.get("tokens", 0) for e in entries), max((e.get("updated_at", 0) for e in entries), default=0)
    return tokens / (last - started) if started and tokens and last > started else None


def verify_skipped(conn, config: RunConfig) -> dict | None:
    """Why the run's verify stage does not run (None: it runs). By default it runs wherever it can:
    on Kubernetes (a verify Job), or where a worker of the verify queue (which has vLLM) is up."""
    if config.verify.enabled:
        return None
    later = f"later: `eyrie verify --run {config.run}` where vLLM is installed"
    if config.verify.enabled is False:
        return {"skipped": "verify.enabled is false in the run config", "fix": later}
    settings = load_settings()
    if settings.gpu_scheduler == "kueue":
        if VERIFY.name in load_templates(settings.kueue_jobs_file).get("stages", {}):
            return None
        return {"skipped": "the chart renders no verify Job", "fix": f"set gpuJobs.verify.enabled: true, or {later}"}
    if workers_on(conn, VERIFY.queue):
        return None
    return {"skipped": "no worker of the verify queue is up (it runs where vLLM is installed)",
            "fix": "start one (`eyrie worker verify`; in the Compose stack, the verifier service) before the "
                   f"run exports, set verify.enabled: true to wait for one, or {later}"}


def verify_timeout_s(conn, config: RunConfig, manifest) -> int:
    """The verify task's time budget from its plan: per pass (the target alone, then once per K) a
    vLLM start within the serve deadline and three times its greedy tokens at the rate generation
    measured (else a floor of MIN_VERIFY_TOK_S); benchmark sets counted at their --prompts cap."""
    request = config.verify
    cap = request.prompts or BENCHMARK_PROMPTS_BOUND
    prompts = min(cap, manifest.train.heldout_samples) + cap * len(request.benchmarks)
    tokens = prompts * (request.max_tokens or manifest.generate.sampling.max_tokens)
    measured = generate_tok_s(conn, config.run) or 0.0
    passes = 1 + max(1, len(request.ks))
    return int(passes * (load_settings().serve_deadline_s + 3 * tokens / max(measured, MIN_VERIFY_TOK_S)))


def drained_run(conn, store) -> str | None:
    """A pipeline whose generation has drained (no generate task queued, scheduled or running, so
    no request in flight) while its later stages still wait: the server may stop and hand over
    the GPUs. None while anything is generating."""
    if live_tasks(conn, "generate"):
        return None
    for run in sorted(m.decode() for m in conn.smembers(keys.ACTIVE_PIPELINES)):
        try:
            manifest = load_run_manifest(store, run)
        except EyrieError:
            continue
        layout = Layout(run)
        generated = all(store.exists(layout.generate_shard_manifest(p.index)) for p in manifest.generate_shards)
        if generated and (manifest.drafter is None or manifest.verify is None) and not _stalled(conn, store, run):
            return run
    return None


def _stalled(conn, store, run: str) -> bool:
    """Blocked, cancelled or with a task failed for good: its later stages wait for a person, not
    for the GPUs (a restarted inference service must not stay down for it)."""
    if conn.exists(keys.blocked(run), keys.cancelled(run)):
        return True
    ids = run_job_ids(store, run)
    return any(job_state(conn, job_id) == "failed" for job_id in ids["extract"] + ids["train"])


def run_job_ids(store, run: str) -> dict[str, list[str]]:
    """Every task id the run may have, by queue (raises UnknownRun for an unknown run)."""
    manifest = load_run_manifest(store, run)
    shards = [p.index for p in manifest.generate_shards]
    return {"generate": [GENERATE.task_id(run, i) for i in shards],
            "extract": [EXTRACT.task_id(run, i) for i in shards] + [PLAN_EXTRACT.task_id(run)],
            "train": [TRAIN.task_id(run), FETCH.task_id(run)], "verify": [VERIFY.task_id(run)]}


def start_extract(conn, store, run: str, extract: ExtractSettings):
    """Plan the extract stage (or check it against its plan) and enqueue what is missing."""
    return entry(EXTRACT.start)(conn, store, run, extract)


def _all_extracted(store, manifest, layout) -> bool:
    return all(store.exists(layout.extract_shard_manifest(p.index)) for p in manifest.generate_shards)


def on_task_done(job, connection, result, *args, **kwargs) -> None:
    """RQ's on_success callback of every task: move the run's pipeline on."""
    run = (job.args[0] or {}).get("run") if job.args else None
    if run:
        advance_or_record(connection, open_store(load_settings()), run)


def advance_or_record(conn, store, run: str, retry_blocked: bool = False) -> str | None:
    """advance, unless a refusal blocks the run (only `eyrie run`, the user's rerun, retries it)."""
    if conn.exists(keys.cancelled(run)):
        return None  # cancelled: nothing more starts until `eyrie retry` or `eyrie run`
    if retry_blocked:
        conn.delete(keys.blocked(run))
    elif conn.exists(keys.blocked(run)):
        return None
    try:
        return advance(conn, store, run)
    except EyrieError as exc:
        block(conn, run, exc)
        return None


def block(conn, run: str, exc: EyrieError) -> None:
    """A refusal the user must fix (storage budget, a base drafter that does not fit): no retry,
    shown by status until `eyrie run` is run again."""
    log.warning("run %s: the next stage did not start: %s", run, exc)
    conn.set(keys.blocked(run), str(exc))

