"""speculators' trainer run in-process: the CPU shim, the fast-path fallback, total max-steps,
checkpoint hooks and live metrics. The training loop is speculators' own.

Pinned to speculators 0.9.0: `check_internals()` fails loudly (and a test calls it) if the
internals this module relies on change."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from eyrie_trainer.stop_signal import StopSignal

SPECULATORS_VERSION = "0.9.0"
SAFE_PATH = {"draft_attn_impl": "sdpa", "loss_implementation": "eager"}
FAST_PATH = {"draft_attn_impl": "simple_flex_attention", "loss_implementation": "fused"}


@dataclass
class Hooks:
    """What the trainer tells eyrie while speculators trains."""

    on_metrics: Callable[[dict], None] = lambda record: None
    on_checkpoint: Callable[[str, int, int], None] = lambda label, epoch, local_step: None
    on_step: Callable[[int], None] = lambda global_step: None  # raises to stop (lease lost)
    on_start: Callable[[int, int], None] = lambda steps_per_epoch, global_step: None
    on_dropped: Callable[[str], None] = lambda reason: None  # why speculators left a sample out
    # steps, interrupted; read: training rows trained on; dropped_rows: {row: why} left out and not read since
    state: dict = field(default_factory=dict)


def check_internals() -> None:
    """The speculators internals the shim touches, as of 0.9.0."""
    from importlib.metadata import version

    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    problems = []
    if version("speculators") != SPECULATORS_VERSION:
        problems.append(f"speculators {version('speculators')} is installed, the shim is for {SPECULATORS_VERSION}")
    if getattr(cli, "Trainer", None) is not trainer.Trainer:
        problems.append("speculators.train.cli no longer constructs speculators.train.trainer.Trainer")
    for name in ("setup_model", "train_epoch", "val_epoch", "maybe_save_checkpoint", "maybe_update_best"):
        if not hasattr(trainer.Trainer, name):
            problems.append(f"Trainer.{name} is gone")
    if "step_callback" not in inspect.signature(trainer.Trainer.train_epoch).parameters:
        problems.append("Trainer.train_epoch lost its step_callback")
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as sampler

    if not hasattr(sampler, "_generate_batches"):
        problems.append("the batch sampler's _generate_batches is gone")
    import torch.optim._muon as muon

    if "grad.bfloat16()" not in inspect.getsource(getattr(muon, "_zeropower_via_newtonschulz", lambda: None)):
        problems.append("torch.optim._muon._zeropower_via_newtonschulz changed")
    if not hasattr(trainer, "_StepTimer") or "torch.accelerator.synchronize" not in inspect.getsource(trainer._StepTimer):
        problems.append("speculators.train.trainer._StepTimer changed")
    if not callable(getattr(checkpointer, "get_current_device", None)):
        problems.append("speculators.train.checkpointer no longer calls get_current_device")
    if problems:
        raise RuntimeError("eyrie's speculators shim needs updating: " + "; ".join(problems))


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 natively: a GPU, or a CPU past AVX2 whose oneDNN has bf16
    kernels (AVX512-BF16, AMX). On an AVX2-only CPU torch emulates bf16 matmuls: 60x slower than
    fp32 at the SmolLM2 drafter's shapes (bench/RESULTS.md, "The trainer's cost on the CPU")."""
    if not device.startswith("cpu"):
        return True
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2") \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's orthogonalization (torch/optim/_muon.py), the same iteration in fp32
    instead of bf16: on a CPU without native bf16 its emulated bf16 matmuls made Muon ~30x slower
    (23.6 vs 0.8 CPU-s a step at the SmolLM2 drafter's shapes)."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    ortho = grad.float().T if tall else grad.float()
    ortho = ortho / ortho.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if tall else ortho


def fast_path(settings, device: str) -> bool:
    """Whether to try speculators' fast path (flex attention, fused loss): EYRIE_TRAIN_FAST_PATH, auto on CUDA."""
    return {"on": True, "off": False}.get(settings.train_fast_path, device.startswith("cuda"))


def loader_workers(settings, device: str) -> int:
    """Data-loader processes: EYRIE_TRAIN_LOADER_WORKERS, else 2 on CUDA and 0 elsewhere (on a 2-core host a
    worker process takes a core from the training step)."""
    workers = settings.train_loader_workers
    return workers if workers is not None else (2 if device.startswith("cuda") else 0)


def autocast_dtype(device: str) -> str:
    """speculators' hidden_states_dtype (its autocast and loader dtype; master weights are fp32
    either way): bf16, its default, where the device computes it natively, else fp32."""
    return "bfloat16" if native_bf16(device) else "float32"


def _fast_skips(sampler) -> bool:
    """speculators' Trainer._prepare_resume_skip slices the sampler's cached batches where it has these."""
    return hasattr(sampler, "_generate_batches") and hasattr(sampler, "_cached_generated_batches")


def _trainer_class(device: str, hooks: Hooks):
    from speculators.train.graceful_shutdown import with_graceful_shutdown
    from speculators.train.trainer import Trainer

    class EyrieTrainer(Trainer):
        """speculators' Trainer on any device, stopping at total max-steps, reporting to eyrie."""

        def setup_model(self):
            self.local_rank = device  # speculators moves to local_rank: an index means CUDA
            self.device_type = torch.device(device).type
            super().setup_model()

        @with_graceful_shutdown()
        def run_training(self):
            # speculators' loop without its barriers (one device), stopping at max_steps in total:
            # its own loop would run one more step in every later epoch.
            with StopSignal(hooks.state):
                hooks.state.setdefault("read", set())
                hooks.state.setdefault("dropped_rows", {})
                hooks.on_start(len(self.train_loader), self.global_step)
                for epoch in range(self.current_epoch, self.config.num_epochs):
                    if self._reached_max_steps():
                        break
                    hooks.state["epoch"] = epoch
                    skipped = getattr(self, "_resume_local_step", 0) if epoch == self.current_epoch else 0
                    hooks.state["epoch_start_step"] = self.global_step - skipped
                    # resumed mid-epoch, speculators' fast-skip caches only the epoch's remaining batches
                    hooks.state["sliced_off"] = skipped if _fast_skips(self.train_loader.batch_sampler) else 0
                    hooks.state["pending_drops"] = {}
                    self.train_epoch(epoch, step_callback=self._after_step)
                    self.maybe_save_checkpoint(epoch)
                    self.maybe_update_best(epoch, self.val_epoch(epoch))

        def _after_step(self) -> None:
            hooks.state["updating"] = False
            hooks.state["steps"] = hooks.state.get("steps", 0) + 1
            self._count_rows()
            if hooks.state.get("signalled"):  # a stop the data path swallowed: stop at this step's end
                from speculators.train.graceful_shutdown import TrainingInterruptedError

                raise TrainingInterruptedError(hooks.state["signalled"])
            hooks.on_step(self.global_step)

        def _count_rows(self) -> None:
            """The training rows of the batch just trained on: read, or left out (speculators' warning
            named the row as the batch was loaded). A row read once is trained on."""
            epoch, state = hooks.state["epoch"], hooks.state
            batches = self.train_loader.batch_sampler._generate_batches(epoch)  # cached per epoch
            batch = batches[self.global_step - state["epoch_start_step"] - state.get("sliced_off", 0) - 1]
            pending = state.get("pending_drops", {})
            for row in map(int, batch):
                if row in pending:
                    if row not in state["read"]:
                        state["dropped_rows"][row] = pending.pop(row)
                else:
                    state["read"].add(row)
                    state["dropped_rows"].pop(row, None)

        def _reached_max_steps(self) -> bool:
            return self.config.max_steps is not None and self.global_step >= self.config.max_steps

        def _optimizers_step(self):
            # from the update to speculators' `global_step += 1` a stop waits for the step's end
            # (StopSignal): raised in between, the checkpoint would hold the step uncounted and the
            # next attempt train its batch twice
            hooks.state["updating"] = True
            super()._optimizers_step()

        def maybe_save_checkpoint(self, epoch, local_step: int = 0):
            if epoch == "interrupted":  # a SIGTERM: save where we are, as a resumable mid-epoch point
                hooks.state["interrupted"] = True
                epoch = hooks.state.get("epoch", 0)
                local_step = self.global_step - hooks.state.get("epoch_start_step", 0)
                if local_step <= 0:
                    return
            marker = self.checkpointer.path / str(epoch) / "training_state.json"
            before = marker.stat().st_mtime_ns if marker.exists() else None
            super().maybe_save_checkpoint(epoch, local_step=local_step)
            if marker.exists() and marker.stat().st_mtime_ns != before:  # it did save
                hooks.on_checkpoint(str(epoch), epoch, local_step)

    return EyrieTrainer


def _install_no_sync_step_timer(trainer_module) -> Callable[[], None]:
    """speculators' step timer synchronizes the accelerator, which fails where there is none.
    Returns the undo."""
    original = trainer_module._StepTimer

    class CpuStepTimer(original):
        def mark(self, name):
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self):
            return time.perf_counter() if self.enabled else None

    trainer_module._StepTimer = CpuStepTimer
    return lambda: setattr(trainer_module, "_StepTimer", original)


class _MetricsHandler(logging.Handler):
    """speculators logs each step's metrics as a dict on 'speculators.metrics', and why it leaves a
    sample out as a warning: its retries to the extraction service exhausted, or generated states
    whose token ids are not the sample's (a Python warning, captured as a log record)."""

    def __init__(self, hooks: Hooks):
        super().__init__()
        self.hooks = hooks

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "speculators.metrics" and isinstance(record.msg, dict) \
                and not getattr(record, "hparams", False):
            self.hooks.on_metrics(record.msg)
        elif record.levelno >= logging.WARNING:
            message = record.getMessage()
            reason = drop_reason(message)
            if reason:
                self.hooks.on_dropped(reason)
                row = dropped_row(message)
                if row is not None:
                    self.hooks.state.setdefault("pending_drops", {})[row] = reason


def dropped_row(message: str) -> int | None:
    """The dataset row speculators' drop warning names ("for index 3", "dataset index 3")."""
    found = re.search(r"(?:for index|dataset index) (\d+)", message)
    return int(found.group(1)) if found else None


def drop_reason(message: str) -> str | None:
    """speculators' warning for a sample it leaves out, as one short line (its token ids cut off)."""
    if "consecutive failures=" in message:
        return message.splitlines()[0][:300]
    if "Loaded token ids" in message and "match input ids" in message:
        return "the generated hidden states' token ids do not match the sample's"
    return None


@contextlib.contextmanager
def speculators_patched(device: str, hooks: Hooks) -> Iterator[None]:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_module

    import torch.optim._muon as muon

    check_internals()
    original, undo_timer, current_device = cli.Trainer, None, checkpointer.get_current_device
    newton_schulz = muon._zeropower_via_newtonschulz
    cli.Trainer = _trainer_class(device, hooks)
    if not device.startswith("cuda"):
        checkpointer.get_current_device = lambda: device  # it answers "cuda:0" when there is no accelerator
        undo_timer = _install_no_sync_step_timer(trainer_module)
    if not native_bf16(device):
        muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    handler = _MetricsHandler(hooks)
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        cli.Trainer, checkpointer.get_current_device = original, current_device
        muon._zeropower_via_newtonschulz = newton_schulz
        if undo_timer:
            undo_timer()
        logging.getLogger().removeHandler(handler)
        logging.captureWarnings(False)


def speculators_config(options: Mapping[str, Any]):
    """speculators' own TrainConfig from its settings by name (`total_seq_len`, not a flag), built
    and checked by its argv-free core as its CLI would (each one counts as given)."""
    from speculators.train.config import TrainConfig
    from speculators.train.config.schema import CONFIG_DESTS

    unknown = sorted(set(options) - CONFIG_DESTS)
    if unknown:
        raise RuntimeError(f"speculators {SPECULATORS_VERSION} has no training settings {unknown}")
    try:  # the command recorded in the checkpoints' train_command.txt: the `speculators train` equivalent
        return TrainConfig.from_sources(cli=dict(options), argv=["speculators", "train", *as_argv(options)])
    except ValueError as exc:  # pydantic's ValidationError, speculators' ConfigError (e.g. a draft-init conflict)
        raise RuntimeError(f"speculators refused the training settings: {exc}") from None


def resolve_argv(argv: list[str]):
    """speculators' TrainConfig from a `speculators train` command line (its own parser)."""
    from speculators.train.config import TrainConfig

    try:
        return TrainConfig.resolve(argv)
    except SystemExit:  # argparse's way of refusing; its message is in the log above
        raise RuntimeError(f"speculators refused the training arguments {argv}") from None


def train(config, device: str, hooks: Hooks) -> None:
    """speculators' `train` entry, in this process, with our Trainer subclass. `config`: its
    TrainConfig, or a `speculators train` command line."""
    from speculators.train.cli import main

    cfg = resolve_argv(config) if isinstance(config, list) else config
    with speculators_patched(device, hooks), verifier_code(cfg.verifier.trust_remote_code):
        main(cfg)


@contextlib.contextmanager
def verifier_code(trust: bool) -> Iterator[None]:
    """The verifier config loads speculators' trust_remote_code misses (0.9.0: Eagle3DraftModel's
    load_verifier_weights and from_pretrained, in training and each checkpoint's load), trusted too."""
    import speculators.models.eagle3.core as core

    auto, resolve = core.AutoConfig, core.resolve_target_layer_ids
    if trust:
        core.AutoConfig = SimpleNamespace(from_pretrained=functools.partial(auto.from_pretrained, trust_remote_code=True))
        core.resolve_target_layer_ids = functools.partial(resolve, trust_remote_code=True)
    try:
        yield
    finally:
        core.AutoConfig, core.resolve_target_layer_ids = auto, resolve


def train_with_fallback(settings: Mapping[str, Any] | list[str], device: str, fast_path: bool, hooks: Hooks,
                        log: Callable[[str], None]) -> dict:
    """The fast path (flex attention, fused loss, torch.compile) where asked; if it fails before
    its first step, speculators' sdpa + eager path, said out loud. Returns the path taken.
    `settings`: speculators' settings by name, or a `speculators train` command line."""
    if fast_path:
        hooks.state["steps"] = 0
        try:
            train(_with_path(settings, FAST_PATH), device, hooks)
            return {"path": "fast", **FAST_PATH}
        except Exception as exc:
            if hooks.state.get("steps", 0) > 0:
                raise
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"fast path failed before its first step ({reason}); falling back to sdpa + eager loss")
            train(_with_path(settings, SAFE_PATH), device, hooks)
            return {"path": "fallback", **SAFE_PATH, "fast_path_error": reason}
    train(_with_path(settings, SAFE_PATH), device, hooks)
    return {"path": "safe", **SAFE_PATH}


def _with_path(settings: Mapping[str, Any] | list[str], path: dict):
    if isinstance(settings, list):
        return settings + path_flags(path)
    return speculators_config({**settings, **path})


def as_argv(options: Mapping[str, Any]) -> list[str]:
    """speculators' settings as its command line: `--total-seq-len 8192`, a list as its items."""
    argv = []
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def path_flags(path: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in path.items()]
