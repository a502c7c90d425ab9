"""`eyrie run --plan`'s result, typed: its sections as dataclasses whose fields are in the order
`--json` prints them (orjson writes a dataclass's fields in order)."""

from __future__ import annotations

from dataclasses import dataclass, field

DOWNLOAD = "download"  # the row of Plan.hours for the target's weights from the hub


@dataclass
class Lengths:
    """Training must see what extraction stored: the tokens past train.seq_len are stored, then cut."""

    extract_max_length: int
    train_seq_len: int
    unseen_tokens_upper_bound: int


@dataclass
class TrainRecipe:
    """The recipe the trainer will choose (eyrie.core.recipe) for the expected training tokens."""

    epochs: int
    steps: int
    lr: float
    warmup: float
    schedule: str
    seq_len: int
    device: str
    statement: str


@dataclass(kw_only=True)
class Space:
    """The bytes of every copy (the bucket's, the trainer's local one) against the free space where
    each goes; a free space or a fit is None where this host cannot see it."""

    bucket_bytes: int
    trainer_copy_bytes: int
    mode: str
    bucket_dir: str | None
    trainer_dir: str | None
    bucket_free: int | None = None
    trainer_free: int | None = None
    same_device: bool = False
    basis: str  # "upper bound" or "expected mean", as the plan's bytes are
    fits_bucket: bool | None = None
    fits_trainer: bool | None = None


@dataclass(kw_only=True)
class ModeCosts:
    """One storage mode's row (eyrie.runs.storage_plan.mode_costs); hours are None where a rate is unknown."""

    stored_fraction: float  # the share of the samples whose hidden states the bucket keeps
    stored_bytes: int
    bucket_bytes: int
    trainer_cache_bytes: int
    extraction_passes: float
    service_gpu_hours_per_pass: float | None
    service_gpu_hours: float | None  # held: offline through extraction, hybrid and online through training
    service_gpu_hours_busy: float | None
    trainer_gpu_hours: float | None
    wall_hours: float | None
    fits: bool
    gpus_at_once: int


@dataclass(kw_only=True)
class ServiceMemory:
    """One GPU of the vLLM extraction service, in bytes (eyrie.runs.storage_plan.service_memory)."""

    weights: int
    kv_floor: int
    runtime: int
    total: int
    weights_total: int
    weights_from: str
    kv_tokens: int
    gpus: int


@dataclass(kw_only=True)
class TrainerMemory:
    """The trainer's GPU, in bytes (eyrie.runs.storage_plan.trainer_memory)."""

    parameters: int
    frozen: int
    activations: int
    runtime: int
    total: int
    trainable_params: int
    seq_len: int
    ttt_steps: int


@dataclass(kw_only=True)
class GpuSharing:
    """Whether the extraction service and the trainer fit one GPU (hybrid and online run both at once)."""

    gpu_bytes: int
    gpu_memory_from: str
    service: ServiceMemory
    trainer: TrainerMemory
    utilization: float  # vLLM's --gpu-memory-utilization as serve.extra_args sets it, else its default
    service_fits: bool
    trainer_fits_beside: bool
    utilization_for_both: float | None  # the highest at which both fit; None: at none
    gpus_apart: int
    host_gpus: int | None
    trainer_on_service_gpus: list[str]


@dataclass(kw_only=True)
class StoragePlan:
    """Each storage mode's costs, the mode asked, the one the run takes and why (eyrie.runs.storage_plan)."""

    asked: str
    chosen: str | None  # None: auto, and not even the token ids fit
    backend: str
    basis: str
    modes: dict[str, ModeCosts]
    why: str
    gpu_sharing: GpuSharing


@dataclass(kw_only=True)
class GpuPlan:
    """The GPUs each service of the stack is given against what the run asks (eyrie.runs.plan_checks.gpu_plan)."""

    ids: dict[str, list[str]]  # by service, where EYRIE_<SERVICE>_GPU_IDS is set
    serve_gpus: int
    sequenced: bool  # the GPU lease gives each GPU one holder at a time
    shared: dict[str, list[str]]  # "a+b": the GPUs both are given
    refusals: list[tuple[str, str]]


@dataclass(kw_only=True)
class Plan:
    """What a pipeline will cost, from its config alone. eyrie.runs.projection.project fills it in
    this order: the fields without a default at once (the target's shape, the samples, the bytes,
    the lengths), then each other one from those before it. Three sections stay dicts, keyed by
    name: `requests` (plan_inputs.requests), `hours` (by stage name and DOWNLOAD, then `basis` and
    `total`) and `support` (eyrie.core.support.check)."""

    per_1k_tokens_per_sample: dict[str, int]  # hidden-state bytes per 1,000 tokens of mean sample length, by dtype
    run: str
    target: str
    shape_from: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    architecture: str | None
    aux_layers: list[int]
    samples: int
    max_tokens: int
    concurrency: int
    prompt_tokens_estimate: int
    mean_tokens: int | None
    mean_tokens_from: str | None
    stored_mean_tokens: int | None  # the mean, cut at extract.max_length
    tokens_upper_bound: int
    dataset_from: str
    requests: dict
    hidden_states_bytes: dict[str, int]  # at the upper bound, by dtype
    hidden_states_bytes_expected: int | None  # at the stored mean, in extract.dtype
    records_bytes: int
    dtype: str
    budget_bytes: int | None
    all_states_fit: bool | None
    all_states_fit_expected: bool | None
    target_weights_bytes: int | None = None
    target_weights_from: str | None = None
    serve_deadline_s: float | None = None
    target_download_bytes: int | None = None
    generate_measured: tuple[float, str] | None = None  # (tok/s, where from), once the run has generated
    states_from: str | None = None  # the earlier run whose states this one reuses (eyrie.runs.reuse)
    # generate settings the run config leaves to the generator host ({field: this host's value and source})
    decided_elsewhere: dict = field(default_factory=dict)
    answers_from: str | None = None  # the published answers it trains on (eyrie.runs.from_answers)
    lengths: Lengths
    train_recipe: TrainRecipe | None = None
    hours: dict = field(default_factory=dict)
    support: dict = field(default_factory=dict)
    gpus: GpuPlan | None = None
    storage: StoragePlan | None = None
    fits: bool | None = None  # the mode the run takes within extract.budget (None: no budget)
    fits_expected: bool | None = None
    space: Space | None = None
    refusals: list[tuple[str, str]] = field(default_factory=list)
