"""Each stage's settings, declared once: a run config's `generate:`, `extract:` and `train:`
sections, the options of `eyrie generate|extract|train` (eyrie/commands/cli_options.py makes them from
these fields), the API's body and a task's request are these models; the run manifest records
the plan made from them (eyrie.data.manifest's GenerateParams, ExtractParams, TrainParams)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_serializer, model_validator

from eyrie.core import recipe as recipes
from eyrie.core.budget import parse_size
from eyrie.core.errors import EyrieError
from eyrie.core.section import Section

MAX_HELDOUT = 500
CLI_ONLY_IN_PLAN = {"cli": False}  # a field no stage command takes (read by `eyrie run --plan` only)
# how fast or how robustly the answers are fetched, not what they are: left out of the fingerprint
# a run's states are found by (eyrie.runs.reuse)
PACING = {"pacing": True}


def pacing_fields(model: type[BaseModel]) -> set[str]:
    """The fields of a section marked PACING."""
    return {name for name, field in model.model_fields.items() if (field.json_schema_extra or {}).get("pacing")}


class StageSettings(Section):
    """What a stage asks for. A setting not given takes the default here, or on a rerun what was
    planned: which ones were given is kept (model_fields_set), and only those are written out (a
    stored config, a task's payload), so a rerun checks only what was asked."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """null (a config written before the defaults lived here, a JSON client): not given."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {name: value for name, value in handler(self).items() if name in self.model_fields_set}

    def with_host_defaults(self, host: "StageSettings"):
        """These settings where a field not given takes the host's default: `host`, the settings a
        deployment sets (eyrie.core.config.Settings.generate_defaults: EYRIE_<FIELD>, e.g. EYRIE_MAX_RETRIES);
        still only the given count as asked."""
        resolved = type(self).model_validate({**host.given(), **self.given()})
        object.__setattr__(resolved, "__pydantic_fields_set__", set(self.model_fields_set))
        return resolved


class DatasetSection(Section):
    """The prompts the generate stage answers (frozen into the store when it is planned)."""

    source: str = Field(min_length=1, description="Local .jsonl/.parquet/dataset directory, or HF id.",
                        json_schema_extra={"flag": "dataset"})
    split: str = Field("train", min_length=1, description="Dataset split (HF datasets).")
    revision: str | None = Field(None, description="Dataset revision (HF datasets).")
    limit: int | None = Field(None, ge=1, description="Use only the first N rows.")


class GenerateSettings(StageSettings):
    """How the target answers the prompts (the run manifest's `generate`)."""

    concurrency: int = Field(200, ge=1, description="Requests in flight per worker.", json_schema_extra=PACING)
    max_tokens: int = Field(8192, ge=1, description="Completion token limit.")
    request_timeout_s: float = Field(1800.0, gt=0, description="Per-request timeout, seconds.",
                                     validation_alias=AliasChoices("request_timeout_s", "timeout_s"),
                                     json_schema_extra={"flag": "timeout", **PACING})
    temperature: float | None = Field(None, ge=0, description="Sampling temperature (unset: the server's).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling (unset: the server's).")
    max_retries: int = Field(5, ge=0, le=50, description="Retries of a request on 5xx, timeouts, drops.",
                             json_schema_extra=PACING)
    retry_backoff_s: float = Field(2.0, ge=0, description="First retry delay; doubles, capped at 60 s.",
                                   json_schema_extra=PACING)
    shard_size: int = Field(1000, ge=1, description="Rows per task.", json_schema_extra=PACING)
    turns: Literal["all", "last"] = Field("all", description="all: the target answers every user turn of a "
                                                             "conversation in order, one request each, with its "
                                                             "own earlier answers in the context (the dataset's "
                                                             "assistant text is never trained on); last: one "
                                                             "request, the last user turn after the dataset's "
                                                             "text.")
    prompt_tokens_estimate: int = Field(512, ge=1, description="For --plan only: mean prompt length.",
                                        json_schema_extra={**CLI_ONLY_IN_PLAN, **PACING})


class ExtractSettings(StageSettings):
    """Which hidden states are recorded, and how (the run manifest's `extract`)."""

    layers: list[int] | None = Field(None, description="Aux layer ids, e.g. 2,16,29 (unset: [2, n//2, n-3]).")
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="bf16, or fp8 (e4m3, per-token scales).")
    max_length: int | None = Field(None, ge=2, description="Longer samples are truncated (or skipped if "
                                                           "the prompt alone is longer).")
    budget: str | None = Field(None, description="Refuse if the projection exceeds this, e.g. 2.8TB.")
    backend: Literal["hf", "vllm"] = Field("hf", description="hf (transformers) or vllm (docs/vllm-extraction.md).")
    storage: Literal["auto", "offline", "hybrid", "online"] = Field(
        "offline", description="Where training's hidden states come from (docs/storage-modes.md): offline (all "
                               "in the bucket first), hybrid (the bucket up to extract.budget, the rest from the "
                               "vLLM extraction service during training), online (all from the service, every "
                               "epoch), auto (offline where every state fits extract.budget, else hybrid; never "
                               "online, which --plan shows where it would end sooner).")

    @field_validator("layers", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        """`2,16,29` (the command line) is the list [2, 16, 29]."""
        if not isinstance(value, str):
            return value
        try:
            return [int(x) for x in value.split(",")]
        except ValueError:
            raise ValueError("give comma-separated layer ids, e.g. 2,16,29") from None

    @field_validator("budget")
    @classmethod
    def _readable_size(cls, value):
        if value is not None:
            try:
                parse_size(value)
            except EyrieError:
                raise ValueError("write a size like 2.8TB, 500GB or 64GiB") from None
        return value


class TrainSettings(StageSettings):
    """How the drafter is trained (the run manifest's `train`)."""

    base: str | None = Field(None, description="Finetune from this drafter: HF repo id or directory "
                                               "(legacy EAGLE-3 format is converted).")
    base_revision: str | None = Field(None, description="Revision of --base on the hub.")
    epochs: int | None = Field(None, ge=1, description="Epochs (unset: chosen from the training tokens for about "
                                                       f"{recipes.TARGET_STEPS:,} optimizer steps, {recipes.MIN_EPOCHS}-"
                                                       f"{recipes.MAX_EPOCHS} epochs; speculators always runs 20: "
                                                       "steps, not epochs, are what a small set lacks).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps in total.")
    draft_vocab: int = Field(32000, ge=2, description="Draft vocabulary, capped at the target's (speculators' "
                                                      "default is the target's whole vocabulary; 32k as SpecForge "
                                                      "and EAGLE-3 use: the draft lm_head's rows are its cost).")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (speculators' default; 3e-4 learnt nothing in "
                                              "the SmolLM2 runs of issue 28).")
    warmup: float = Field(0.03, ge=0, lt=1, description="Warmup, as a share of all optimizer steps (speculators: "
                                                        "1%, which is 0-10 steps in a small run's few hundred; "
                                                        "SpecForge 1.5%; its optimizer moments settle first).")
    schedule: Literal["linear", "cosine"] = Field("linear", description="Learning-rate decay after warmup, "
                                                                        "to 0 at the last step (speculators').")
    seq_len: int | None = Field(None, ge=16, description="Tokens per packed batch; longer samples are cut there "
                                                         "(speculators' --total-seq-len; unset: "
                                                         f"{recipes.CPU_PACK:,} where training runs on a CPU, whose "
                                                         "dense attention costs more per token the longer the pack, "
                                                         f"{recipes.GPU_PACK:,} (speculators') on a GPU).")
    ttt_steps: int = Field(3, ge=1, le=16, description="Draft steps trained and evaluated: K.")
    loggers: list[Literal["tensorboard"]] = Field(
        default_factory=list, description="speculators' metric loggers, offline: tensorboard writes TensorBoard "
                                          "event files into the run's store prefix (train/tensorboard/).")
    heldout: int | None = Field(None, ge=1, description="Samples held out for evaluation "
                                                        f"(default 10%, at most {MAX_HELDOUT}).")

    @field_validator("loggers", mode="before")
    @classmethod
    def _logger_names(cls, value):
        """`tensorboard` (the command line) is the list [tensorboard]."""
        return [name for name in value.split(",") if name] if isinstance(value, str) else value

    def heldout_for(self, samples: int) -> int:
        return self.heldout or max(1, min(MAX_HELDOUT, samples // 10))

    def recipe(self, train_tokens: int, device: str) -> recipes.Recipe:
        """What training runs with: these settings, the unset ones chosen (eyrie.core.recipe)."""
        return recipes.choose(train_tokens, device, lr=self.lr, warmup=self.warmup, schedule=self.schedule,
                             seq_len=self.seq_len, epochs=self.epochs)
