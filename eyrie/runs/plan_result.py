"""`eyrie run --plan`'s result, typed: its sections as fields, in the order `--json` prints them."""

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
class Plan:
    """What a pipeline will cost, from its config alone. eyrie.runs.projection.project fills it in
    this order: the fields without a default at once (the target's shape, the samples, the bytes,
    the lengths), then each other one from those before it. The dicts are the
    sections other modules build: `requests` (plan_inputs), `hours` (by stage name, then `basis` and
    `total`), `support` (eyrie.core.support.check), `gpus` (plan_checks.gpu_plan), `storage`
    (storage_plan.storage_plan)."""

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
    answers_from: str | None = None  # the published answers it trains on (eyrie.runs.from_answers)
    lengths: Lengths
    train_recipe: TrainRecipe | None = None
    hours: dict = field(default_factory=dict)
    support: dict = field(default_factory=dict)
    gpus: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)
    fits: bool | None = None  # the mode the run takes within extract.budget (None: no budget)
    fits_expected: bool | None = None
    space: Space | None = None
    refusals: list[tuple[str, str]] = field(default_factory=list)
