"""The run config `eyrie run` takes (run.yaml): the run's own sections (`RunConfigBase`), the model built
from them and the stages' sections (`build_run_config`; eyrie.stages.run_config builds it from the
pipeline), the run name's rule and `read_config`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from functools import lru_cache

from pydantic import Field, ValidationError, create_model, field_validator

from eyrie.core.budget import parse_size
from eyrie.core.errors import EyrieError
from eyrie.core.section import Section as _Section

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_run_name(name: str) -> str:
    if not RUN_NAME.fullmatch(name):  # match() let "a\n" through: `$` matches before a last newline
        raise EyrieError(f"invalid run name {name!r}.",
                         "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.")
    return name


class TargetShape(_Section):
    """For `--plan` where the target's config cannot be read (no hub access): its shape."""

    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    architecture: str | None = Field(None, min_length=1, description="config.json's architectures[0].")


class TargetSection(_Section):
    model: str = Field(min_length=1, description="Local directory or HF id of the target.")
    hub_id: str | None = Field(None, min_length=1, description="The hub id a local directory is a copy of: what "
                                                               "exported configs and cards name (never the path).")
    shape: TargetShape | None = None


class ServeSection(_Section):
    """How the target is served (vLLM flags): part of the run, not of the host's .env."""

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    reasoning_parser: str | None = Field(None, min_length=1, description="e.g. kimi_k2, deepseek_r1, qwen3.")
    trust_remote_code: bool = False
    max_model_len: int | None = Field(None, ge=16)
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags, one per item.")

    @classmethod
    def of_host(cls, settings) -> "ServeSection":
        """Where no run config says how to serve (`eyrie serve` alone, `eyrie verify` of a run started
        without one): the host's EYRIE_* vLLM settings, read the one way for every server eyrie starts."""
        return cls(tensor_parallel_size=settings.tensor_parallel_size, reasoning_parser=settings.reasoning_parser,
                   max_model_len=settings.max_model_len, extra_args=shlex.split(settings.vllm_args))

    def trusts_remote_code(self) -> bool:
        """The target's own code runs: trust_remote_code, or the flag among extra_args (a config of a
        stage started alone takes the host's EYRIE_VLLM_ARGS, where the flag may stand)."""
        return self.trust_remote_code or "--trust-remote-code" in self.extra_args

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
    serial_prompts: int = Field(8, ge=1, description="Prompts answered one at a time: tokens/s at 1 in flight, and the "
                                "answers the outputs verdict is judged on (under 8: too few to judge, "
                                "eyrie.data.verify_outputs.MIN_COMPARED).")

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
    target_weights: str | None = Field(None, description="The target's weights in bytes, e.g. 540GB (else its local "
                                                         "safetensors, else a dense bf16 estimate from its shape).")
    gpu_memory: str | None = Field(None, description="Memory of one GPU, for what shares a GPU (else this host's GPU "
                                                     "as nvidia-smi reports it, else an H200's 141GB).")
    download_per_s: str | None = Field(None, description="Bytes a second from the hub to the server's host, e.g. "
                                                         "500MB: the target's weights come down before it answers.")

    @field_validator("target_weights", "gpu_memory", "download_per_s")
    @classmethod
    def _readable_size(cls, value):
        if value is not None:
            try:
                size = parse_size(value)
            except EyrieError:
                size = 0
            if size <= 0:
                raise ValueError("write a size above 0 like 540GB, 141GB or 80GiB")
        return value


class RunConfigBase(_Section):
    """What `eyrie run --config run.yaml` runs: the run's own sections here; every stage's section
    (its settings class) is added by build_run_config, in pipeline order. A run runs every stage, or
    the stages it names (`eyrie generate|extract|train` keep a config naming the stage they start)."""

    run: str = Field(pattern=RUN_NAME.pattern, description="1-64 letters, digits, '.', '_' or '-'.")
    stages: list[str] | None = Field(None, min_length=1, description="The stages this run runs (unset: every "
                                     "stage of the pipeline); a stage started alone is a run of that stage.")
    target: TargetSection
    serve: ServeSection = Field(default_factory=ServeSection)
    plan: PlanSection = Field(default_factory=PlanSection)


@lru_cache(maxsize=None)
def build_run_config(sections: tuple[tuple[str, type[_Section]], ...]) -> type[RunConfigBase]:
    """The run config model: the run's own sections and `sections` (name, settings class), each a
    field of that class, required where the class has a required field (the dataset's source)."""
    fields = {name: (cls, Field(default_factory=cls) if _defaults_alone(cls) else ...) for name, cls in sections}
    return create_model("RunConfig", __base__=RunConfigBase, **fields)


def _defaults_alone(cls: type[_Section]) -> bool:
    return all(not field.is_required() for field in cls.model_fields.values())


def read_config(path: Path, model: type[RunConfigBase]) -> RunConfigBase:
    """`path` (run.yaml) read into `model` (eyrie.stages.run_config.load_config: the pipeline's)."""
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
        config = model.model_validate(raw)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise EyrieError(f"{path}: {fields}.", "correct these fields (README: `eyrie run`).") from None
    check_run_name(config.run)
    return with_absolute_paths(config)


def with_absolute_paths(config: RunConfigBase) -> RunConfigBase:
    """A target directory or a dataset file named relative to where `eyrie run` reads the config,
    made absolute: the stored config then names them for every service that mounts them there (the
    server, the verifier, the generator workers that plan the run), whatever their working directory."""
    model, source = Path(config.target.model), Path(config.dataset.source)
    if not model.is_absolute() and model.is_dir():
        config = config.model_copy(update={"target": config.target.model_copy(update={"model": str(model.resolve())})})
    if not source.is_absolute() and source.exists():
        config = config.model_copy(update={"dataset": config.dataset.model_copy(update={"source": str(source.resolve())})})
    return config
