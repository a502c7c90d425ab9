"""What each storage mode costs (bytes, extraction passes, GPU hours, wall hours) from the plan
`eyrie run --plan` builds; auto's choice; and, since hybrid and online train while the vLLM
extraction service runs, whether the two fit one GPU's memory (docs/storage-modes.md)."""

from __future__ import annotations

import math
from pathlib import Path

from eyrie.core.budget import bytes_per_token, human, parse_size, token_id_bytes
from eyrie.core.errors import EyrieError
from eyrie.core.storage import MODES
from eyrie.runs.plan_inputs import gpu_memory
from eyrie.runs.plan_result import GpuSharing, ModeCosts, Plan, ServiceMemory, StoragePlan, TrainerMemory
from eyrie.stages.extract import Extract
from eyrie.stages.train import Train

TRAINER_GPUS = 1  # eyrie's trainer: speculators on one GPU (the seed's case)


def storage_plan(config, p: Plan) -> StoragePlan:
    """p.storage: each mode's costs, the mode asked, the one the run takes and why."""
    modes = {mode: mode_costs(p, mode) for mode in MODES}
    asked = config.extract.storage
    chosen = auto_choice(modes) if asked == "auto" else asked
    return StoragePlan(asked=asked, chosen=chosen, backend=config.extract.backend, basis=_basis(p), modes=modes,
                       why=_why(asked, chosen, modes, p), gpu_sharing=gpu_sharing(config, p))


def auto_choice(modes: dict[str, ModeCosts]) -> str | None:
    """The first mode that fits the budget, in the order of least extraction work and fewest GPUs
    at once (offline, hybrid, online); None: not even the token ids fit."""
    return next((mode for mode in MODES if modes[mode].fits), None)


def full_and_ids_bytes(p: Plan) -> tuple[int, int]:
    """Every hidden state, and the token ids alone, in bytes: at the expected mean, else the upper bound."""
    n = p.samples
    if p.hidden_states_bytes_expected is not None:
        return p.hidden_states_bytes_expected, token_id_bytes(n * p.stored_mean_tokens, n)
    return p.hidden_states_bytes[p.dtype], token_id_bytes(p.tokens_upper_bound, n)


def stored_fraction(mode: str, full: int, ids: int, budget: int | None) -> float:
    """The share of the samples whose hidden states the bucket keeps (the rest: token ids only).
    hybrid fills the budget: f x full + (1 - f) x ids = budget, the rule each extract shard keeps
    to within its allowance (eyrie_extractor.storage_split: ids-only objects count as states files do)."""
    if mode == "online":
        return 0.0
    if mode == "offline" or budget is None or full <= budget:
        return 1.0
    return min(1.0, max(0.0, (budget - ids) / (full - ids)))


def mode_costs(p: Plan, mode: str) -> ModeCosts:
    """One row of the table: bytes, extraction passes, GPU hours, wall hours, fits, GPUs at once."""
    full, ids = full_and_ids_bytes(p)
    f = stored_fraction(mode, full, ids, p.budget_bytes)
    stored = round(f * full + (1 - f) * ids)
    epochs = p.hours[Train.name]["epochs"]
    passes = f + (1 - f) * epochs
    extract_h, train_h, serve = p.hours[Extract.name]["hours"], p.hours[Train.name]["hours"], p.gpus.serve_gpus
    per_pass = None if extract_h is None else extract_h * serve
    wall = wall_hours(f, extract_h, train_h, epochs)
    busy = per_pass and per_pass * passes
    # offline stops the service once extracted; hybrid and online hold its GPUs until training ends
    held = busy if mode == "offline" else wall and wall * serve
    return ModeCosts(stored_fraction=round(f, 4), stored_bytes=stored, bucket_bytes=stored + p.records_bytes,
                     trainer_cache_bytes=stored + (0 if f == 1 else _one_batch_bytes(p)),
                     extraction_passes=round(passes, 3), service_gpu_hours_per_pass=_round(per_pass),
                     service_gpu_hours=_round(held), service_gpu_hours_busy=_round(busy),
                     trainer_gpu_hours=_round(train_h and train_h * TRAINER_GPUS),
                     wall_hours=_round(wall),
                     fits=p.budget_bytes is None or stored <= p.budget_bytes,
                     gpus_at_once=max(serve, TRAINER_GPUS) if mode == "offline" else serve + TRAINER_GPUS)


def wall_hours(f: float, extract_h: float | None, train_h: float | None, epochs: int) -> float | None:
    """The stored share extracted first, then the epochs; in each, the generated share goes at the
    slower of the trainer and the service (they overlap: the data loader keeps requests in flight).
    offline (f = 1): extract, then train."""
    if extract_h is None or train_h is None:
        return None
    epoch = train_h / epochs
    return f * extract_h + epochs * (f * epoch + (1 - f) * max(epoch, extract_h))


def _one_batch_bytes(p: Plan) -> int:
    """The generated states the trainer holds at once: one batch of train.seq_len tokens (ArrowDataset
    deletes each file once loaded)."""
    return int(p.lengths.train_seq_len * bytes_per_token(len(p.aux_layers) + 1, p.hidden_size, p.dtype))


def _basis(p: Plan) -> str:
    return "upper bound" if p.hidden_states_bytes_expected is None else "expected mean"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _why(asked: str, chosen: str | None, modes: dict[str, ModeCosts], p: Plan) -> str:
    budget = p.budget_bytes
    if asked != "auto":
        fits = "" if modes[asked].fits else ": does NOT fit extract.budget (refused below)"
        return "asked (extract.storage)" + fits
    if chosen is None:
        return "auto: not even the token ids fit extract.budget (refused below)"
    if chosen == "offline":
        return "auto: every hidden state fits extract.budget" if budget is not None else "auto: no extract.budget"
    f = modes[chosen].stored_fraction
    return (f"auto: offline's {human(modes['offline'].stored_bytes)} exceed extract.budget {human(budget)}; "
            f"{chosen} stores {f:.1%} of the samples' hidden states and the service makes the rest in each of "
            f"{p.hours[Train.name]['epochs']} epochs" + _sooner(chosen, modes))


def _sooner(chosen: str, modes: dict[str, ModeCosts]) -> str:
    """auto goes by extraction work and GPUs held, not wall hours: say when a later mode ends sooner
    (a service faster than the trainer hides its passes behind training)."""
    c = modes[chosen]
    later = [m for m in MODES[MODES.index(chosen) + 1:] if modes[m].fits and modes[m].wall_hours is not None
             and c.wall_hours is not None and modes[m].wall_hours < c.wall_hours]
    if not later:
        return ""
    m = modes[later[0]]
    return (f"; {later[0]} would end sooner ({m.wall_hours:,.1f} h) at {m.service_gpu_hours:,.1f} service "
            f"GPU-h held and {m.gpus_at_once} GPUs at once: extract.storage: {later[0]} to take it")


# --- hybrid and online: the extraction service and the trainer hold GPUs at the same time ---

VLLM_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization: the share of each GPU it takes at start
RUNTIME_BYTES = 4 * 10**9  # a process's own share of a GPU (CUDA context, NCCL buffers, CUDA graphs): an allowance


def gpu_sharing(config, p: Plan) -> GpuSharing:
    """Per GPU: the service's and the trainer's memory, whether the trainer fits beside the service
    at vLLM's utilization, and the highest utilization at which it would."""
    gpu, gpu_from = gpu_memory(config)
    service, trainer = service_memory(config, p), trainer_memory(config, p)
    used = vllm_utilization(config.serve.extra_args)
    most = math.floor((gpu - trainer.total) / gpu * 100) / 100  # the highest share that leaves the trainer room
    ids = p.gpus.ids
    return GpuSharing(gpu_bytes=gpu, gpu_memory_from=gpu_from, service=service, trainer=trainer, utilization=used,
                      service_fits=service.total <= gpu,
                      trainer_fits_beside=service.total <= used * gpu and trainer.total <= (1 - used) * gpu,
                      utilization_for_both=most if service.total <= most * gpu else None,
                      gpus_apart=config.serve.gpus + TRAINER_GPUS,
                      host_gpus=len(set().union(*ids.values())) if ids else None,
                      trainer_on_service_gpus=sorted(set(ids.get("trainer", [])) & set(ids.get("inference", [])),
                                                     key=int))


def vllm_utilization(extra_args: list[str]) -> float:
    """--gpu-memory-utilization from serve.extra_args, else vLLM's default."""
    for i, arg in enumerate(extra_args):
        value = arg.split("=", 1)[1] if arg.startswith("--gpu-memory-utilization=") else (
            extra_args[i + 1] if arg == "--gpu-memory-utilization" and i + 1 < len(extra_args) else None)
        if value is not None:
            return _fraction(value)
    return VLLM_UTILIZATION


def _fraction(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise EyrieError(f"serve.extra_args: --gpu-memory-utilization {value} is not a share of the GPU.",
                         "write a number above 0 and at most 1, e.g. 0.68.")
    return share


def service_memory(config, p: Plan) -> ServiceMemory:
    """One GPU of the vLLM service: its share of the target's weights (tensor x pipeline parallel
    split them), a KV cache of one max_model_len sequence (below that vLLM refuses to start) and
    the runtime. The KV floor is an upper bound: K and V of every layer at full hidden width in bf16
    (GQA and MLA, Kimi's, store less)."""
    weights, source = target_weights(config, p)
    gpus = config.serve.gpus
    tokens = config.serve.max_model_len or p.lengths.extract_max_length
    kv = 2 * p.num_layers * p.hidden_size * 2 * tokens
    parts = {"weights": weights // gpus, "kv_floor": kv // gpus, "runtime": RUNTIME_BYTES}
    return ServiceMemory(**parts, total=sum(parts.values()), weights_total=weights, weights_from=source,
                         kv_tokens=tokens, gpus=gpus)


def target_weights(config, p: Plan) -> tuple[int, str]:
    """The target's weight bytes: plan.target_weights, else its local safetensors, else a dense
    bf16 model of its shape (attention 4H^2 + MLP 8H^2 a layer, embeddings and head 2VH)."""
    if config.plan.target_weights:
        return parse_size(config.plan.target_weights), "plan.target_weights"
    try:
        files = [f.stat().st_size for f in Path(config.target.model).glob("*.safetensors")]
    except (OSError, ValueError):  # a name this host cannot look at: not a local directory
        files = []
    if files:
        return sum(files), "the target's safetensors files"
    h = p.hidden_size
    dense = 2 * (12 * p.num_layers * h * h + 2 * p.vocab_size * h)
    return dense, "estimated as a dense bf16 model of its shape: set plan.target_weights for a MoE or quantized one"


def trainer_memory(config, p: Plan) -> TrainerMemory:
    """speculators' EAGLE-3 drafter on one GPU: fc (aux states -> H), one decoder layer whose q, k, v
    read 2H (the token's embedding beside the fused state), an MLP, the draft-vocabulary head;
    frozen: the target's embeddings and its head cut to the draft vocabulary."""
    h, vocab = p.hidden_size, p.vocab_size
    draft, aux = min(config.train.draft_vocab, vocab), len(p.aux_layers)
    inter = 7 * h // 2  # the MLP width is not in the shape: Llama's 3.5 H (DeepSeek-V3's 2.6 H: an overestimate there)
    trainable = aux * h * h + 7 * h * h + 3 * h * inter + h * draft
    seq, steps = p.lengths.train_seq_len, config.train.ttt_steps  # the pack the trainer will use
    # a token: its aux states (bf16), and per TTT step the layer's saved activations (~10 H + 3 I, bf16)
    # and the draft and target logits over the draft vocabulary (fp32)
    per_token = aux * h * 2 + steps * ((10 * h + 3 * inter) * 2 + 2 * draft * 4)
    # 16 B a trainable parameter: speculators keeps fp32 weights (bf16 autocast), fp32 gradients, Adam's two moments
    parts = {"parameters": trainable * 16, "frozen": (vocab + draft) * h * 4, "activations": seq * per_token,
             "runtime": RUNTIME_BYTES}
    return TrainerMemory(**parts, total=sum(parts.values()), trainable_params=trainable, seq_len=seq, ttt_steps=steps)


# --- what --plan prints ---

def storage_lines(p: Plan) -> list[str]:
    s = p.storage
    budget = f"extract.budget {human(p.budget_bytes)}" if p.budget_bytes is not None else "no extract.budget"
    lines = [f"  storage modes (extract.storage: {s.asked}; {s.basis}; {budget}):",
             "    mode    |    bucket | trainer cache | extraction passes | service GPU-h held (busy) | "
             "trainer GPU-h |  wall h | fits"]
    for mode, m in s.modes.items():
        lines.append(f"    {mode:<7} | {human(m.stored_bytes):>9} | {human(m.trainer_cache_bytes):>13} | "
                     f"{m.extraction_passes:>17.2f} | "
                     f"{_hours(m.service_gpu_hours) + ' (' + _hours(m.service_gpu_hours_busy) + ')':>25} | "
                     f"{_hours(m.trainer_gpu_hours):>13} | {_hours(m.wall_hours):>7} | "
                     + ("yes" if m.fits else "no"))
    return lines + [f"    chosen: {s.chosen or 'none'} ({s.why})",
                    f"    (bucket: hidden states + token ids, what extract.budget bounds; the records add "
                    f"{human(p.records_bytes)} in every mode. service GPU-h held: its {p.gpus.serve_gpus} GPUs x "
                    "the hours it holds them: offline, extraction; hybrid and online, through training (wall h); "
                    "busy: extraction hours x passes. wall h: extraction and training, after generation; hybrid and "
                    "online train while the service makes the states not stored, at the slower of the two rates)"]


def _hours(h: float | None) -> str:
    return "?" if h is None else f"{h:,.1f}"


def sharing_lines(p: Plan) -> list[str]:
    g = p.storage.gpu_sharing
    svc, trn = g.service, g.trainer
    return [f"  GPU memory ({human(g.gpu_bytes)} a GPU, {g.gpu_memory_from}):",
            f"    extraction service: {human(svc.total)} a GPU on {svc.gpus} (target "
            f"{human(svc.weights_total)} ({svc.weights_from}) / {svc.gpus} = {human(svc.weights)}, "
            f"KV floor {human(svc.kv_floor)} for "
            f"one {svc.kv_tokens:,}-token sequence, runtime {human(svc.runtime)}); vLLM takes "
            f"{g.utilization:.2f} of each GPU ({human(g.utilization * g.gpu_bytes)})",
            f"    trainer: {human(trn.total)} on {TRAINER_GPUS} ({trn.trainable_params / 1e9:.2f} B drafter "
            f"parameters x 16 B = {human(trn.parameters)}, frozen embeddings and head {human(trn.frozen)}, "
            f"activations {human(trn.activations)} for {trn.seq_len:,} tokens x {trn.ttt_steps} TTT steps, "
            f"runtime {human(trn.runtime)})"] + _sequence_lines(g, p.storage.chosen)


def _sequence_lines(g: GpuSharing, chosen: str | None) -> list[str]:
    serve = g.service.gpus
    if not g.service_fits:
        return [f"    the target does not fit {serve} GPUs ({human(g.service.total)} a GPU): serve it on more "
                "(serve.tensor_parallel_size, pipeline_parallel_size)"]
    lines = [f"    offline: one holder at a time: generate and extract on the service's {serve} GPUs, then train "
             f"on {TRAINER_GPUS}",
             f"    hybrid and online: the service on {serve} GPUs while the trainer trains: {g.gpus_apart} GPUs; "
             + _beside(g)]
    if chosen in ("hybrid", "online"):
        lines.append(f"    so {chosen} needs a host with {g.gpus_apart} GPUs (the trainer's own beside the "
                     f"service's {serve})" + (f", or the extraction service at --gpu-memory-utilization "
                                              f"{g.utilization_for_both:.2f} with the trainer on one of its GPUs "
                                              "(their GPU leases share it)"
                                              if g.utilization_for_both and not g.trainer_fits_beside else ""))
        lines += _split_lines(g, chosen)
    return lines


def _beside(g: GpuSharing) -> str:
    gpu, used, trainer = g.gpu_bytes, g.utilization, g.trainer.total
    if g.trainer_fits_beside:
        return (f"the trainer fits beside the service on one of its GPUs at gpu_memory_utilization {used:.2f} "
                f"({human((1 - used) * gpu)} left)")
    most = g.utilization_for_both
    if most is None:
        return (f"they cannot share a GPU at any utilization (the service {human(g.service.total)} + the "
                f"trainer {human(trainer)} > {human(gpu)})")
    return (f"the trainer does not fit beside the service at gpu_memory_utilization {used:.2f} "
            f"({human((1 - used) * gpu)} left); it does at {most:.2f} (the service gets {human(most * gpu)} >= "
            f"{human(g.service.total)}, {human((1 - most) * gpu)} left for the trainer's {human(trainer)})")


def _split_lines(g: GpuSharing, chosen: str) -> list[str]:
    """The stack's split (.env) against what hybrid and online hold at once."""
    shared, host, most = g.trainer_on_service_gpus, g.host_gpus, g.utilization_for_both
    if not shared:
        return []
    where = f"    this host's split gives the trainer GPU {','.join(shared)}, one of inference's ({host} GPUs in all): "
    if most is None:
        return [where + f"the two cannot share it, so {chosen} needs the trainer on a GPU outside "
                        "EYRIE_INFERENCE_GPU_IDS" + ("" if host >= g.gpus_apart else ": add a GPU, or a budget that "
                                                     "holds offline")]
    if host >= g.gpus_apart:
        return [where + f"the trainer trains beside the service, at --gpu-memory-utilization {most:.2f} (a GPU "
                        "outside EYRIE_INFERENCE_GPU_IDS leaves vLLM its full share)"]
    return [where + f"on {host} GPUs {chosen} runs only with the service at --gpu-memory-utilization {most:.2f} and "
                    f"the trainer on GPU {shared[0]} beside it: eyrie serve-extract starts it so (or add a GPU)"]
