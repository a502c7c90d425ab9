"""The one configuration object: every EYRIE_* environment variable, validated at start. No other
module reads an EYRIE_* variable (tests/unit/test_architecture.py checks it): a field here, or
`Settings.generate_defaults` for the generate settings' host defaults, EYRIE_<FIELD>."""

from __future__ import annotations

import copy
import functools
import os
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import Field, SecretStr, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import GenerateSettings
from eyrie.core.vllm import resolve_command

DEFAULT_TINY_MODEL = "assets/tiny-target"


class Settings(BaseSettings):
    """Where the services meet (Redis, store, server) and the defaults of every stage."""

    model_config = SettingsConfigDict(env_prefix="EYRIE_", extra="ignore", env_ignore_empty=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", repr=False,  # may hold the password
                           description="Queues, run state, leases.")
    redis_wait_s: float = Field(120.0, ge=0, description="How long a worker starting waits for Redis to answer "
                                "(with backoff, saying so) before it exits naming it; a running one rides out a "
                                "Redis restart as well.")
    store_url: str = Field("file://.eyrie/store", description="file://DIR or s3://BUCKET[/PREFIX].")
    s3_endpoint: str | None = Field(None, description="S3/MinIO endpoint, e.g. http://minio:9000.")
    s3_access_key: SecretStr | None = None
    s3_secret_key: SecretStr | None = None
    s3_region: str | None = None

    inference_url: str | None = Field(
        None, description="OpenAI-compatible base URL(s), comma-separated, each optionally URL#WEIGHT "
                          "(its share of the requests in flight); unset: the endpoints `eyrie serve` published."
    )
    model: str = Field(DEFAULT_TINY_MODEL, description="Target model: local directory or HF id.")
    server: Literal["transformers", "vllm"] = "transformers"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    tensor_parallel_size: int = Field(1, ge=1)
    reasoning_parser: str | None = None
    max_model_len: int | None = Field(None, ge=16)
    vllm_args: str = Field("", description="Extra vLLM flags, shell-quoted.")
    vllm_command: str = Field("vllm", validate_default=True,
                              description="The vLLM executable, or a Python that has vLLM (default: `vllm` on "
                                          "PATH, else the .venv-vllm/bin/python `make setup` installs).")
    advertise_url: str | None = Field(None, description="URL workers use to reach this server.")
    endpoint_name: str = Field("default", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                               description="Name this server is published under (one per replica).")
    endpoint_weight: int = Field(1, ge=1, description="This replica's share of the requests in flight.")
    serve_deadline_s: float = Field(3600.0, gt=0, description="How long a server may take to answer: `eyrie serve` "
                                    "for its own, generate and extract tasks for theirs; verify budgets it per vLLM start.")
    gpu_wait_s: float = Field(12 * 3600.0, gt=0, description="How long a task waits for the GPUs in all (its own "
                              "lease, or its server's; and `eyrie verify`) before it fails for good naming the holder "
                              "(`eyrie retry` waits again); not counted against its RQ timeout or attempts "
                              "(eyrie.work.gpu_wait). A cancel or a SIGTERM ends a task's wait at once.")
    plan_wait_s: float = Field(3600.0, gt=0, description="How long `eyrie run` (and `eyrie generate|extract|train`) "
                               "waits for a stage's planning task a worker took before it stops waiting, saying so.")
    serve_stop_when_drained: bool | None = Field(
        None, description="Stop the server once a pipeline's generation has drained and its later stages "
                          "wait (handing over the GPU lease); unset: yes for vLLM, which holds the GPUs.")

    device: str = Field("auto", description="Extractor device: auto (cuda if present), cpu, cuda, cuda:N, or "
                                            "cuda:0,cuda:1,... (the HF backend spreads the target over them; "
                                            "with cuda it does so over every GPU when one cannot hold it).")
    extract_batch_tokens: int = Field(16384, ge=1, description="Padded tokens per forward batch.")
    extract_vllm_url: str | None = Field(None, description="vLLM extraction server (extract --backend vllm); "
                                                           "unset: the one `eyrie serve-extract` published.")
    extract_shared_dir: str = Field(".eyrie/hs-shared", description="Where the vLLM extraction server writes "
                                                                   "hidden states; the extractor reads the same path.")
    extract_write_threads: int = Field(4, ge=1, description="Uploads running beside the forward.")

    cache_dir: str = Field(".eyrie/cache", description="Local cache: training data, checkpoints, base drafters.")
    train_fast_path: Literal["auto", "on", "off"] = Field(
        "auto", description="speculators' flex attention + fused loss: auto = on a GPU (falls back "
                            "to sdpa + eager loss by itself if it fails), off = always sdpa + eager.")
    train_loader_workers: int | None = Field(
        None, ge=0, description="speculators' dataloader worker processes; unset: 2 on a GPU, 0 on the CPU "
                                "(its spawned workers each import torch, then only compete for the cores).")
    train_stall_s: float = Field(
        1800, gt=0, description="Training with no step and no new epoch for this long is stalled: its stacks "
                                "go to the log, its data-loader workers are ended (with none, the training "
                                "is interrupted) and it resumes from its last checkpoint (twice at most, "
                                "then the task fails).")

    api_token: SecretStr | None = Field(None, description="Bearer token every mutating API call needs; "
                                                          "unset: the API refuses them all.")
    api_open_reads: bool = Field(False, description="Let GET calls (runs, status, metrics, dashboard data) "
                                                    "through without the token.")
    api_host: str = Field("127.0.0.1", description="Bind address of `eyrie api`.")
    api_port: int = Field(8080, ge=1, le=65535, description="Port of `eyrie api`.")
    api_dataset_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Directories (comma-separated) POST /runs may read a local dataset "
                                          "from; empty: local paths are refused through the API (hub ids pass).")

    # The stack's split of a host's GPUs (.env; compose.gpu.yml reserves them, docker-compose.yml
    # passes them to every service): read by `eyrie run --plan` and `eyrie run`, which refuse a
    # serve: section the inference service's GPUs cannot hold (eyrie.runs.plan_checks.gpu_plan).
    inference_gpu_ids: str | None = Field(None, pattern=r"^\d+(,\d+)*$",
                                          description="GPU ids of inference and the vLLM extraction server.")
    extractor_gpu_ids: str | None = Field(None, pattern=r"^\d+(,\d+)*$", description="GPU ids of the extractor.")
    trainer_gpu_ids: str | None = Field(None, pattern=r"^\d+(,\d+)*$", description="GPU ids of the trainer.")

    gpu_scheduler: Literal["redis", "kueue"] = Field(
        "redis", description="Who decides which stage may use the GPUs now: redis = the lease in Redis (one "
                             "host, Compose); kueue = Kueue admits a Job per GPU stage (Kubernetes, docs/kubernetes.md).")
    gpu_host: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._-]{1,128}$",
        description="The machine whose GPUs this service uses, as the GPU lease names it (redis only): the same on "
                    "every service of one machine, different on each machine; unset: the kernel's boot id, which "
                    "every container of a machine shares (their hostnames differ), else the hostname.")
    gpu_ids: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*$",
        description="The machine's ids of this service's GPUs (its CUDA devices 0, 1, ... in order), comma-separated, "
                    "e.g. 4,5,6: the GPU lease takes those (redis only); unset: NVIDIA_VISIBLE_DEVICES (Docker's "
                    "--gpus, Compose's device_ids) narrowed by CUDA_VISIBLE_DEVICES; neither: the whole machine.")
    kueue_jobs_file: str = Field("/etc/eyrie/gpu-jobs.json", description="The chart's Job templates of the GPU "
                                                                        "stages (kueue only).")
    kubernetes_api: str | None = Field(None, description="Kubernetes API server URL (kueue only); unset: the pod's "
                                                         "own service account, in-cluster.")
    kubernetes_namespace: str | None = Field(None, description="Namespace of the GPU Jobs; unset: the pod's own.")
    job_run: str | None = Field(None, description="The run whose GPU Job this pod is (kueue only): the chart's Job "
                                                  "template sets it from the Job's annotation.")

    data_dir: str | None = Field(None, description="The S3 bucket's directory on this host (the stack's MinIO "
                                                   "volume): `eyrie run --plan` reads its free space there when "
                                                   "neither the store's directory nor the S3 server says it.")
    debug: bool = Field(False, description="`eyrie` shows the traceback of an internal error (a bug of ours) "
                                           "instead of one line.")

    def generate_defaults(self) -> GenerateSettings:
        """This host's defaults of the generate settings a run does not give (a deployment's
        default, e.g. EYRIE_MAX_RETRIES): EYRIE_<FIELD> for each field of GenerateSettings, read
        from the environment when asked (a run is planned) and checked by those fields; the ones
        set are its given (GenerateSettings.with_host_defaults takes them)."""
        env = {name: value for name in GenerateSettings.model_fields
               if (value := os.environ.get(f"EYRIE_{name.upper()}"))}
        try:
            return GenerateSettings.model_validate(env)
        except ValidationError as exc:
            raise _refused(exc, "correct these environment variables.") from None

    @field_validator("api_dataset_roots", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [part.strip() for part in v.split(",") if part.strip()] if isinstance(v, str) else v

    @field_validator("vllm_command")
    @classmethod
    def _project_vllm(cls, v: str) -> str:
        return resolve_command(v)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if urlparse(v).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be redis://HOST:PORT/DB, rediss://… or unix://PATH")
        return v

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, v: str) -> str:
        parsed = urlparse(v)
        if parsed.scheme not in ("file", "s3"):
            raise ValueError("must be file://DIR (local) or s3://BUCKET[/PREFIX] (S3/MinIO)")
        if parsed.scheme == "s3" and not parsed.netloc:
            raise ValueError("s3:// needs a bucket name: s3://BUCKET[/PREFIX]")
        return v

    @field_validator("inference_url")
    @classmethod
    def _inference_urls(cls, v: str | None) -> str | None:
        if v is None:
            return v
        for url, _ in parse_endpoints(v):
            _check_http(url)
        return ",".join(f"{u}#{w}" if w != 1 else u for u, w in parse_endpoints(v))

    @field_validator("s3_endpoint", "advertise_url", "extract_vllm_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return _check_http(v.rstrip("/")) if v else v

    @field_validator("s3_endpoint")
    @classmethod
    def _no_credentials_in_endpoint(cls, v: str | None) -> str | None:
        if v and "@" in urlparse(v).netloc:
            raise ValueError("must not hold credentials: set EYRIE_S3_ACCESS_KEY and EYRIE_S3_SECRET_KEY")
        return v


def _check_http(v: str) -> str:
    if urlparse(v).scheme not in ("http", "https") or not urlparse(v).netloc:
        raise ValueError("must be an http(s)://HOST:PORT URL")
    return v


def parse_endpoints(value: str) -> list[tuple[str, int]]:
    """`http://a:8000#3,http://b:8000` -> [(url, weight)]; weight 1 where none is given."""
    endpoints = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        url, _, weight = item.partition("#")
        if weight and (not weight.isdigit() or int(weight) < 1):
            raise ValueError(f"weight of {url} must be a whole number >= 1, not {weight!r}")
        endpoints.append((url.rstrip("/"), int(weight) if weight else 1))
    if not endpoints:
        raise ValueError("no URL given")
    return endpoints


SECRET_FIELDS = {"s3_access_key", "s3_secret_key", "api_token"}


def safe_url(url: str) -> str:
    """The URL without its user and password, for messages and logs."""
    if "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _shown(loc: tuple, value) -> str:
    """A refused value as an error message shows it: never a secret, never a URL's password."""
    if loc and loc[0] in SECRET_FIELDS:
        return "'***'"
    return repr(safe_url(value) if isinstance(value, str) else value)


def _refused(exc: ValidationError, fix: str) -> EyrieError:
    """One error listing every bad value by its variable."""
    lines = []
    for err in exc.errors():
        name = "EYRIE_" + "_".join(str(p) for p in err["loc"]).upper()
        lines.append(f"{name}={_shown(err['loc'], err.get('input'))}: {err['msg']}")
    return EyrieError("invalid configuration: " + "; ".join(lines), fix)


def load_settings(**overrides) -> Settings:
    """Read EYRIE_* from the environment; raise one EyrieError listing every bad value."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise _refused(exc, "correct these environment variables (or flags) and start again.") from None


class _Alone(BaseSettings):
    model_config = Settings.model_config


@functools.cache
def _alone(name: str) -> type[BaseSettings]:
    field = Settings.model_fields[name]
    return create_model(f"Settings_{name}", __base__=_Alone, **{name: (field.annotation, copy.copy(field))})


def one_setting(name: str) -> Any:
    """One field of Settings read alone, by its type and bounds (not for a field with a validator
    of its own, e.g. vllm_command): where reading them all costs too much (every enqueue asks for
    the GPU scheduler; Settings takes milliseconds) or the others may be what failed (the CLI's
    last resort asks for EYRIE_DEBUG). A bad value: one EyrieError naming it."""
    try:
        return getattr(_alone(name)(), name)
    except ValidationError as exc:
        raise _refused(exc, "correct this environment variable.") from None
