"""What a run is made of: the run manifest, shard manifests, the kept run config and where each object lives."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

import eyrie
from eyrie.core.errors import UnknownRun
from eyrie.core.gguf_target import conversion_hub_id
from eyrie.core.run_config import check_run_name
from eyrie.core.stage_settings import TrainSettings


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def code_version() -> str:
    """Package version plus the git commit this code came from, where it can be known."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{eyrie.__version__}+{sha}" if sha else eyrie.__version__


STATES_INDEX = "states"  # eyrie.runs.reuse's index of complete states, the one prefix outside runs/
# what a run that trains on another's states reads of the owner's: its input rows, its generated
# answers and its hidden states, with their shard manifests (eyrie.data.shared_states)
_SHARED = re.compile(r"^runs/(?P<owner>[^/]+)/(?:generate/(?:input|shards)|extract/shards)/")


def states_index(fingerprint: str, dataset_revision: str | None = None) -> str:
    """The reuse index's entry of the states some settings made of a dataset's content; without a
    revision, the prefix of those settings' entries (eyrie.runs.reuse)."""
    prefix = f"{STATES_INDEX}/{fingerprint}/"
    return prefix if dataset_revision is None else f"{prefix}{dataset_revision}.json"


class Layout:
    """Store keys of one run. Every stage writes only under its own prefix."""

    def __init__(self, run: str):
        self.run = check_run_name(run)
        self.root = f"runs/{run}"

    @property
    def manifest(self) -> str:
        return f"{self.root}/manifest.json"

    @property
    def pipeline_config(self) -> str:
        """The run config `eyrie run` keeps (eyrie.runs.pipeline.save_config; read by stored_config)."""
        return f"{self.root}/pipeline.json"

    def generate_input(self, shard: int) -> str:
        return f"{self.root}/generate/input/shard-{shard:05d}.jsonl"

    def generate_parts(self, shard: int) -> str:
        return f"{self.root}/generate/parts/shard-{shard:05d}/"

    def generate_shard(self, shard: int) -> str:
        return f"{self.root}/generate/shards/shard-{shard:05d}.jsonl"

    def generate_shard_manifest(self, shard: int) -> str:
        return f"{self.root}/generate/shards/shard-{shard:05d}.manifest.json"

    @property
    def generate_shards(self) -> str:
        """The prefix of the generated shards and their manifests."""
        return f"{self.root}/generate/shards/"

    def extract_parts(self, shard: int) -> str:
        return f"{self.root}/extract/parts/shard-{shard:05d}/"

    def extract_sample(self, shard: int, sample_id: str) -> str:
        return f"{self.root}/extract/shards/shard-{shard:05d}/{sample_id}.safetensors"

    def shard_of_extract_sample(self, key: str) -> int:
        """The shard an extract_sample key belongs to."""
        return int(key.removeprefix(f"{self.root}/extract/shards/shard-")[:5])

    def extract_shard_manifest(self, shard: int) -> str:
        return f"{self.root}/extract/shards/shard-{shard:05d}.manifest.json"

    @property
    def extract_shards(self) -> str:
        """The prefix of the hidden states and the extract shards' manifests."""
        return f"{self.root}/extract/shards/"

    @property
    def train(self) -> str:
        return f"{self.root}/train"

    def checkpoint_file(self, label: str, name: str) -> str:
        return f"{self.root}/train/checkpoints/{label}/{name}"

    def checkpoint_manifest(self, label: str) -> str:
        return f"{self.root}/train/checkpoints/{label}.manifest.json"

    @property
    def checkpoints(self) -> str:
        """The prefix of the stored checkpoints and their manifests."""
        return f"{self.root}/train/checkpoints/"

    def tensorboard_file(self, name: str) -> str:
        """speculators' TensorBoard event files (`name`: relative to its log directory)."""
        return f"{self.root}/train/tensorboard/{name}"

    @property
    def train_curve(self) -> str:
        return f"{self.root}/train/curve.json"

    @property
    def train_samples(self) -> str:
        """What the trainer read: samples trained on, left out (with why), truncated (eyrie_trainer.ledger)."""
        return f"{self.root}/train/samples.json"

    @property
    def evaluation(self) -> str:
        return f"{self.root}/train/evaluation.json"

    def drafter_file(self, name: str) -> str:
        return f"{self.root}/train/drafter/{name}"

    @property
    def drafter_manifest(self) -> str:
        return f"{self.root}/train/drafter.manifest.json"

    def shard_manifest(self, stage: str, shard: int) -> str:
        return getattr(self, f"{stage}_shard_manifest")(shard)

    def parts(self, stage: str, shard: int) -> str:
        return getattr(self, f"{stage}_parts")(shard)

    @property
    def users(self) -> str:
        """The prefix of the runs that train on this run's answers and states (eyrie.data.shared_states)."""
        return f"{self.root}/used-by/"

    def user(self, run: str) -> str:
        return f"{self.users}{check_run_name(run)}.json"

    @staticmethod
    def owner_of_shared(key: str) -> str | None:
        """The run whose input rows, answers or hidden states `key` is one of; None for another key."""
        owned = _SHARED.match(key)
        return owned["owner"] if owned else None


class DatasetRef(BaseModel):
    source: str = Field(description="HF dataset id, or the local file/directory it was read from.")
    kind: str = Field(description="jsonl | parquet | hf")
    revision: str = Field(description="HF commit sha, or sha256 of the local file(s).")
    split: str = "train"
    row_start: int = 0
    row_end: int


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # a hub repository id: NAME or OWNER/NAME


class TargetRef(BaseModel):
    model: str  # where the target lies on the host that planned the run (for reading, never compared)
    hub_id: str | None = None  # the hub id it is (a hub target's own id, or target.hub_id of a local copy)
    revision: str
    chat_template_sha256: str | None
    server: str
    conversion: dict | None = None  # how eyrie made the target's directory (eyrie/core/gguf_target.py)
    trust_remote_code: bool = False  # the target's own code runs in every load of it (serve.trust_remote_code)

    def public_name(self) -> str:
        """What a user on another host names this target by (an exported config, a card): its hub id where
        known, else its directory's name; never a path of the host that planned the run."""
        return self.public_hub_id() or Path(self.model).name

    def public_hub_id(self) -> str | None:
        """target.hub_id, else a hub target's own name, else the hub id of what eyrie converted its directory
        from (eyrie.core.gguf_target); None where none is known."""
        if self.hub_id:
            return self.hub_id
        return conversion_hub_id(self.conversion) if self._is_local() else self.model

    def _is_local(self) -> bool:
        # describe() records a local directory by its resolved path and a sha256: revision; the check holds on
        # a host where that path does not exist
        return (self.revision.startswith("sha256:") or self.model.startswith(("/", ".", "~"))
                or not HUB_ID.fullmatch(self.model) or Path(self.model).exists())


class SamplingParams(BaseModel):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None


class GenerateParams(BaseModel):
    sampling: SamplingParams
    concurrency: int
    request_timeout_s: float
    max_retries: int
    retry_backoff_s: float = 2.0
    shard_size: int
    turns: str = "last"  # all | last (a manifest from before the setting: last)
    think_start: str = "<think>"
    think_end: str = "</think>"


class ExtractParams(BaseModel):
    backend: str  # hf | vllm
    aux_layers: list[int]
    dtype: str  # bf16 | fp8
    max_length: int | None
    num_layers: int
    hidden_size: int
    samples: int
    tokens: int
    truncated: int
    projected_bytes: int
    budget_bytes: int | None
    storage: Literal["offline", "hybrid", "online"] = "offline"  # extract.storage resolved (never auto)
    # hybrid: the hidden-state bytes each shard may store (the budget over the shards); past it a
    # sample's token ids alone are stored and training asks the extraction service for its states
    shard_allowance_bytes: int | None = None


class BaseDrafter(BaseModel):
    source: str = Field(description="HF repo id or local directory of the base drafter.")
    revision: str | None = None
    legacy: bool = Field(False, description="converted from the legacy EAGLE-3 format")
    hidden_size: int
    target_vocab: int
    draft_vocab: int
    aux_layers: list[int]


class TrainParams(BaseModel):
    """The train plan: eyrie.core.stage_settings.TrainSettings resolved (defaults, the target's or the
    base's vocabulary, the held-out count), under the names manifests have always used."""

    epochs: int
    max_steps: int | None = Field(None, description="Total optimizer steps (all epochs).")
    draft_vocab: int
    vocab_mapping: str = Field(description="frequency: built from the run's loss-masked tokens; "
                                           "base: the base drafter's own d2t/t2d.")
    num_layers: int = 1
    ttt_steps: int = TrainSettings.model_fields["ttt_steps"].default  # a plan from before K was planned
    lr: float
    warmup: float | None = Field(None, description="Warmup share of all steps (None: a plan from before it was "
                                                   "planned, speculators' 1%).")
    schedule: str = "linear"
    total_seq_len: int
    train_samples: int
    heldout_samples: int
    base: BaseDrafter | None = None
    speculators_version: str
    loggers: list[str] = Field(default_factory=list, description="speculators' metric loggers (tensorboard).")
    recipe: str | None = Field(None, description="The recipe and why: eyrie.core.recipe's statement.")

    def settings(self) -> dict:
        """What was planned, by the names of TrainSettings (a rerun's request is checked against it)."""
        return {"base": self.base.source if self.base else None, "epochs": self.epochs, "max_steps": self.max_steps,
                "draft_vocab": self.draft_vocab, "lr": self.lr, "seq_len": self.total_seq_len,
                "ttt_steps": self.ttt_steps, "heldout": self.heldout_samples, "warmup": self.warmup,
                "schedule": self.schedule, "loggers": self.loggers}


class ShardPlan(BaseModel):
    index: int
    row_start: int
    row_end: int
    input_key: str
    input_sha256: str


class RunManifest(BaseModel):
    run: str
    created_at: str
    code_version: str
    target: TargetRef
    dataset: DatasetRef
    generate: GenerateParams
    generate_shards: list[ShardPlan]
    input_skips: dict[str, int] = Field(default_factory=dict,
                                        description="rows unreadable at planning, by reason")
    extract: ExtractParams | None = None
    states_from: str | None = Field(None, description="The run whose generated answers and hidden states this run "
                                                      "trains on (same target, dataset, generate and extract "
                                                      "settings): its shard manifests refer to that run's objects.")
    answers_from: dict | None = Field(None, description="Where the run's answers came from where it generated none: "
                                                       "a published answers set (eyrie.data.answers_set): where, "
                                                       "revision, the run that generated them, samples, the "
                                                       "prompts' license.")
    train: TrainParams | None = None
    settings: dict[str, dict[str, dict]] = Field(
        default_factory=dict, description="Each stage's settings as used, by section: {field: {value, source}} "
                                          "(eyrie.core.provenance), recorded by the stage's planner.")
    drafter: dict | None = Field(None, description="The exported drafter: objects, sha256, τ, path taken.")
    verify: dict | None = Field(None, description="The drafter served by vLLM: its acceptance, identical outputs.")


class Counts(BaseModel):
    total: int = 0
    done: int = 0
    skipped: int = 0
    failed: int = 0
    tokens: int = 0  # generate: completion tokens; extract: tokens forwarded
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bytes: int = 0
    on_demand: int = 0  # extract, hybrid/online: samples stored as token ids, their states made in training

    def add(self, other: "Counts") -> "Counts":
        return Counts(**{k: getattr(self, k) + getattr(other, k) for k in Counts.model_fields})


class ShardManifest(BaseModel):
    run: str
    stage: str
    shard: int
    object: str | None = None  # generate: the shard's JSONL
    sha256: str | None = None
    bytes: int
    counts: Counts
    skip_reasons: dict[str, int]
    failure_errors: dict[str, int]
    examples: dict[str, dict[str, dict]] = Field(
        default_factory=dict, description="One sample per skip reason and per failure error (the keys "
                                          "of skip_reasons, failure_errors): {skipped|failed: {key: "
                                          "{sample_id, row, detail}}}")
    started_at: str
    finished_at: str
    worker: str
    samples: list[dict] = Field(default_factory=list, description="extract: one entry per object")
    not_done: list[dict] = Field(default_factory=list, description="extract: sample_id, status and "
                                                                   "reason or error of each sample not stored")
    mismatches: int = 0  # extract: server token ids that disagree with the chat template
    truncated: int = 0  # extract: samples cut to --max-length
    turns_rerendered: int = 0  # extract: earlier answers the final context holds otherwise than written
    turns_unsupervised: int = 0  # extract: earlier answers that could not be placed in the final context


def outcomes(records) -> dict:
    """A shard manifest's tallies of its skipped and failed records, by reason and error, and the
    first record of each as its example."""
    keyed = [(r["status"], r["reason"] if r["status"] == "skipped" else (r.get("error") or "")[:80], r)
             for r in records if r["status"] in ("skipped", "failed")]
    examples: dict[str, dict] = {}
    for status, key, r in keyed:
        examples.setdefault(status, {}).setdefault(key, {"sample_id": r.get("sample_id"), "row": r.get("row"),
                                                         "detail": (r.get("error") or r.get("reason") or "")[:500]})
    return {"skip_reasons": dict(Counter(key for status, key, _ in keyed if status == "skipped")),
            "failure_errors": dict(Counter(key for status, key, _ in keyed if status == "failed")),
            "examples": examples}


def load_run_manifest(store, run: str) -> RunManifest:
    layout = Layout(run)
    try:
        return RunManifest.model_validate(store.get_json(layout.manifest))
    except KeyError:
        raise UnknownRun(f"unknown run {run!r}: no {layout.manifest} in {store.url}.",
                         "check the name (`eyrie status` lists nothing for it) or start it with "
                         "`eyrie generate --run NAME --dataset …`.") from None


def config_key(run: str) -> str:
    return Layout(run).pipeline_config
