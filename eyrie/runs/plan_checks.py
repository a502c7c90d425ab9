"""What `eyrie run --plan` refuses before any GPU work, with the ways out and their numbers: hidden
states expected (at plan.mean_tokens) over extract.budget, and GPUs the stack's services are given
(EYRIE_<SERVICE>_GPU_IDS) that cannot carry the run's serve: section, would have two owners, or
that the trainer would wait for forever (hybrid and online, where it cannot train beside the service,
or where Kueue's quota cannot hold the service's Job and the trainer's at once)."""

from __future__ import annotations

import math

from eyrie.core.budget import (TOKEN_ID_BYTES, UNITS, human, length_that_fits, projected_bytes, samples_that_fit,
                               token_id_bytes)
from eyrie.core.errors import EyrieError
from eyrie.core.storage import ON_DEMAND
from eyrie.runs.plan_result import GpuPlan, GpuSharing, Plan
from eyrie.runs.storage_plan import auto_choice
from eyrie.stages import TRAIN
from eyrie.stages.generate import Generate
from eyrie.work import k8s_jobs


def unknown_mean(p: Plan) -> tuple[str, str] | None:
    """The budget cannot be checked: the mode asked does not fit it at the upper bound, and no mean
    sample length is known (plan.mean_tokens unset, the dataset a hub id --plan does not read)."""
    s = p.storage
    if p.budget_bytes is None or p.hidden_states_bytes_expected is not None:
        return None
    if s.chosen is not None and s.modes[s.chosen].fits:
        return None
    mode = s.chosen or "online"  # auto with no mode that fits: not even online's token ids
    need = s.modes[mode].stored_bytes
    return (f"run {p.run}: extract.storage {mode} needs up to {human(need)} (every sample at the prompt estimate "
            f"+ max_tokens) but extract.budget is {human(p.budget_bytes)}, and the mean sample length that "
            f"decides it is unknown: {p.dataset_from}.",
            "set plan.mean_tokens (the expected mean sample length, prompt + completion) for the expected bytes, "
            f"or extract.budget: {_at_least(need)}, or extract.storage: hybrid (it fills the budget).")


def over_budget(p: Plan) -> tuple[str, str] | None:
    """(problem, fix) when the storage mode asked cannot hold the expected bytes in extract.budget:
    extract would refuse them only after generation, hours of GPU time later. offline: every hidden
    state; hybrid and online: the token ids (hybrid stores states up to the budget); auto: none of them."""
    budget, s = p.budget_bytes, p.storage
    if budget is None or p.hidden_states_bytes_expected is None:
        return None
    if s.asked == "offline":
        return _offline_over(p)
    if s.chosen is not None and s.modes[s.chosen].fits:
        return None
    return _ids_over(p)


def _offline_over(p: Plan) -> tuple[str, str] | None:
    """Every hidden state over the budget: the ways out, each with its number (the storage modes among them)."""
    budget, expected = p.budget_bytes, p.hidden_states_bytes_expected
    if expected <= budget:
        return None
    n, mean, dtype, prompt = p.samples, p.stored_mean_tokens, p.dtype, p.prompt_tokens_estimate
    shape = (len(p.aux_layers) + 1, p.hidden_size)

    def shorter(d: str) -> list[str]:  # fewer samples, or shorter ones (longer than the prompt estimate)
        limit, length = samples_that_fit(budget, mean, *shape, d), length_that_fits(budget, n, *shape, d)
        return ([f"dataset.limit: {limit:,}"] if limit else []) + (
            [f"extract.max_length: {length:,}"] if length > prompt else [])

    ways = []
    if dtype != "fp8":
        fp8 = projected_bytes(n * mean, n, *shape, "fp8")
        ways.append(f"extract.dtype: fp8 ({human(fp8)})" if fp8 <= budget else
                    f"extract.dtype: fp8 ({human(fp8)}, still too big) with " + " or ".join(shorter("fp8")))
    ways += shorter(dtype)
    ways.append(f"extract.budget: {_at_least(expected)} on a disk that holds it")
    ways += [storage_way(p, mode) for mode in ON_DEMAND if p.storage.modes[mode].fits]
    return (f"run {p.run}: the hidden states are expected to need {human(expected)} ({n:,} samples x "
            f"{mean:,} tokens x {shape[0]} states x {shape[1]} x {dtype}) but extract.budget is {human(budget)}: "
            f"extract would refuse them{_after_generation(p)}.",
            "set " + "; or ".join(ways) + " (--plan again to check).")


def storage_refusal(p: Plan) -> tuple[str, str] | None:
    """What would stop hybrid and online after generation: hybrid without a budget to fill, the hf
    backend (the vLLM extraction service makes the states not stored), and a trainer on a GPU the
    service holds where the two cannot share it."""
    s = p.storage
    if s.asked == "hybrid" and p.budget_bytes is None:
        return (f"run {p.run}: extract.storage: hybrid stores hidden states up to extract.budget, and none is set.",
                "set extract.budget (e.g. 2.8TB), or extract.storage: offline or online.")
    if s.chosen not in ON_DEMAND:
        return None
    chose = "" if s.asked == s.chosen else f" (auto's choice: {s.why.removeprefix('auto: ')})"
    if s.backend == "vllm":
        return on_demand_overlap(p, chose)
    return (f"run {p.run}: extract.storage {s.chosen}{chose} has the vLLM extraction service make hidden "
            f"states during training, and extract.backend is {s.backend}.",
            "set extract.backend: vllm (docs/vllm-extraction.md), or extract.storage: offline with an "
            "extract.budget that holds every state.")


def on_demand_overlap(p: Plan, chose: str = "") -> tuple[str, str] | None:
    """hybrid and online: the vLLM extraction server holds inference's GPUs until training ends (it
    makes the states not stored). A trainer given one of them trains beside it, the service at the
    plan's utilization_for_both (a shared GPU lease); where the two do not fit one GPU at any
    utilization, the trainer would wait for the server forever."""
    g, ids, mode = p.storage.gpu_sharing, p.gpus.ids, p.storage.chosen
    shared = g.trainer_on_service_gpus
    if mode not in ON_DEMAND or not shared or g.utilization_for_both is not None:
        return None
    inference, trainer = ",".join(ids["inference"]), ",".join(ids["trainer"])
    offline = p.storage.modes["offline"].stored_bytes
    return (f"run {p.run}: extract.storage {mode}{chose} trains while the vLLM extraction server serves the "
            f"target on inference's GPUs (EYRIE_INFERENCE_GPU_IDS={inference}) until training ends, and "
            f"EYRIE_TRAINER_GPU_IDS={trainer} shares GPU {','.join(shared)} with them, where the trainer cannot "
            f"train beside the service: the service needs {human(g.service.total)} a GPU and the trainer "
            f"{human(g.trainer.total)}, more than a GPU's {human(g.gpu_bytes)} ({g.gpu_memory_from}) at "
            "any --gpu-memory-utilization, so the trainer would wait for the server forever.",
            f"give the trainer a GPU of its own ({g.gpus_apart} GPUs at once: the service's "
            f"{g.service.gpus} and the trainer's 1): {_apart(ids, g)} in .env; or set extract.storage: "
            f"offline with extract.budget: {_at_least(offline)} on a disk that holds it.")


def on_demand_quota(p: Plan, settings) -> tuple[str, str] | None:
    """Kubernetes (EYRIE_GPU_SCHEDULER=kueue): hybrid and online train while the vLLM extraction
    server's Job holds its GPUs (eyrie.work.kueue.run_jobs); Kueue admits the train Job only where
    the ClusterQueue's quota holds both, or it waits for the server forever."""
    s = p.storage
    mode = s.chosen
    if settings.gpu_scheduler != "kueue" or mode not in ON_DEMAND:
        return None
    chose = "" if s.asked == mode else f" (auto's choice: {s.why.removeprefix('auto: ')})"
    offline = f"extract.storage: offline with extract.budget: {_at_least(s.modes['offline'].stored_bytes)}"
    templates = k8s_jobs.load_templates(settings.kueue_jobs_file)
    (extract_server,) = TRAIN.reads_on_demand
    if extract_server not in templates.get("stages", {}):
        return (f"run {p.run}: extract.storage {mode}{chose} trains from the vLLM extraction server, and the "
                "chart renders no Job for it (gpuJobs.extractServer).",
                f"enable gpuJobs.extractServer (with its sharedClaim and the run's layers), or set {offline}.")
    server, trainer = (k8s_jobs.gpus_of(k8s_jobs.build_job(templates, job, p.run))
                       for job in (extract_server, TRAIN.jobs[-1]))
    quota = templates.get("gpuQuota")
    if quota is None or server + trainer <= quota:
        return None
    return (f"run {p.run}: extract.storage {mode}{chose} trains while the vLLM extraction server's Job holds "
            f"its {server} GPUs and the train Job asks {trainer} more, {server + trainer} at once, but Kueue's "
            f"ClusterQueue has {quota} (kueue.clusterQueue.quota.gpus): the train Job would wait for the server "
            "forever.",
            f"set kueue.clusterQueue.quota.gpus: {server + trainer} (nodes with GPUs for both), or set {offline} "
            "on a disk that holds it.")


def _apart(ids: dict[str, list[str]], g: GpuSharing) -> str:
    """The split that gives the trainer a GPU the service does not hold, on this host if it can."""
    rest = [i for i in ids["inference"] if i not in g.trainer_on_service_gpus]
    if len(rest) >= g.service.gpus:
        return f"EYRIE_INFERENCE_GPU_IDS={','.join(rest)} beside EYRIE_TRAINER_GPU_IDS={','.join(ids['trainer'])}"
    known = set().union(*ids.values())
    spare = next((str(i) for i in range(len(known) + 1) if str(i) not in known))
    return (f"a host with {g.gpus_apart} GPUs, EYRIE_TRAINER_GPU_IDS={spare} beside "
            f"EYRIE_INFERENCE_GPU_IDS={','.join(ids['inference'])}")


def storage_way(p: Plan, mode: str) -> str:
    """A storage mode as a way out, with what it costs: extract.storage: hybrid (2.80 TB in the bucket, ...)."""
    m = p.storage.modes[mode]
    gpu_h = "service GPU-h unknown (set plan.extract_tokens_per_s)" if m.service_gpu_hours is None else \
        f"{m.service_gpu_hours:,.1f} service GPU-h held"
    auto = "; auto picks it" if auto_choice(p.storage.modes) == mode else ""
    return (f"extract.storage: {mode} ({human(m.stored_bytes)} in the bucket, {m.extraction_passes:.2f} "
            f"extraction passes, {gpu_h}, {m.gpus_at_once} GPUs at once{auto})")


def _ids_over(p: Plan) -> tuple[str, str]:
    """Not even the token ids fit (hybrid and online store at least those, auto has no mode left)."""
    budget, n, mean, s = p.budget_bytes, p.samples, p.stored_mean_tokens, p.storage
    ids = s.modes["online"].stored_bytes
    limit = budget // token_id_bytes(mean, 1)
    asked = "no storage mode fits (extract.storage: auto)" if s.asked == "auto" else \
        f"extract.storage: {s.asked} stores at least them"
    ways = ([f"dataset.limit: {limit:,}"] if limit else []) + [f"extract.budget: {_at_least(ids)} or more"]
    return (f"run {p.run}: even the token ids alone are expected to need {human(ids)} ({n:,} samples x {mean:,} "
            f"tokens x {TOKEN_ID_BYTES} B) but extract.budget is {human(budget)}: {asked}, which would show only"
            f"{_after_generation(p)}.", "set " + "; or ".join(ways) + " (--plan again to check).")


def _after_generation(p: Plan) -> str:
    generate = p.hours[Generate.name]["hours"]
    return f" after {generate:,.2f} h of generation" if generate else " after generation"


def _at_least(n: int) -> str:
    """A size to write in a config, rounded up (5,873,254,406,400 bytes: 5.88TB)."""
    for unit in ("TB", "GB", "MB", "kB"):
        if n >= UNITS[unit.upper()]:
            return f"{math.ceil(n / UNITS[unit.upper()] * 100) / 100:.2f}{unit}"
    return f"{n}B"


GPU_SERVICES = ("inference", "extractor", "trainer")


def gpu_plan(config, settings) -> GpuPlan:
    """The GPUs each service of the stack is given (EYRIE_<SERVICE>_GPU_IDS, where this host's
    environment has them) against what the run asks: serve.tensor_parallel_size x
    pipeline_parallel_size on inference's GPUs (the vLLM extraction server serves the target on
    the same ones). Lists may share GPUs only where the GPU lease sequences their services
    (EYRIE_GPU_SCHEDULER=redis: never two holders of one GPU; serve, then extract, then train);
    under kueue each admitted stage owns its GPUs at once, so on one host they must not overlap."""
    given = {name: getattr(settings, f"{name}_gpu_ids") for name in GPU_SERVICES}
    ids = {name: value.split(",") for name, value in given.items() if value}
    sequenced = settings.gpu_scheduler == "redis"
    shared = _shared_gpus(ids)
    refusals = _named_twice(ids, given) + _too_few_for_serve(config, settings, ids, given)
    if shared and not sequenced:
        refusals.append(_two_owners(shared, settings))
    return GpuPlan(ids=ids, serve_gpus=config.serve.gpus, sequenced=sequenced,
                   shared={f"{a}+{b}": gpus for (a, b), gpus in shared.items()}, refusals=refusals)


def _named_twice(ids: dict[str, list[str]], given: dict[str, str]) -> list[tuple[str, str]]:
    refusals = []
    for name, own in ids.items():
        twice = sorted({i for i in own if own.count(i) > 1}, key=int)
        if twice:
            once = ",".join(dict.fromkeys(own))
            refusals.append((f"EYRIE_{name.upper()}_GPU_IDS={given[name]} names GPU {','.join(twice)} twice: "
                             f"{name} gets {len(set(own))} GPUs, not {len(own)}.",
                             f"name each GPU once (EYRIE_{name.upper()}_GPU_IDS={once}) in .env."))
    return refusals


def _too_few_for_serve(config, settings, ids: dict[str, list[str]], given: dict[str, str]) -> list[tuple[str, str]]:
    """Inference's GPUs against the run's serve: section (and EYRIE_TENSOR_PARALLEL_SIZE, `eyrie serve`'s own)."""
    if "inference" not in ids:
        return []
    serve, have = config.serve, len(set(ids["inference"]))
    need = serve.gpus
    shape = f"tensor_parallel_size {serve.tensor_parallel_size}" + (
        f" x pipeline_parallel_size {serve.pipeline_parallel_size}" if serve.pipeline_parallel_size > 1 else "")
    if need > have:
        more = ",".join(str(i) for i in range(need))
        return [(f"run {config.run}: serve: {shape} needs {need} GPUs but inference has {have} "
                 f"(EYRIE_INFERENCE_GPU_IDS={given['inference']}; the vLLM extraction server and "
                 "the verifier serve the target on the same GPUs).",
                 f"give inference {need} GPUs in .env (EYRIE_INFERENCE_GPU_IDS={more}; the extractor "
                 f"and trainer may share them: the GPU lease never gives a GPU two holders), or set "
                 f"serve.tensor_parallel_size: {have} if the target fits {have} GPUs.")]
    if settings.tensor_parallel_size > have:
        return [(f"EYRIE_TENSOR_PARALLEL_SIZE={settings.tensor_parallel_size} (eyrie serve without a "
                 f"run config) needs {settings.tensor_parallel_size} GPUs but inference has {have} "
                 f"(EYRIE_INFERENCE_GPU_IDS={given['inference']}).",
                 f"set EYRIE_TENSOR_PARALLEL_SIZE={have} in .env, or give inference more GPUs.")]
    return []


def _shared_gpus(ids: dict[str, list[str]]) -> dict[tuple[str, str], list[str]]:
    """The GPUs two services are both given, by pair (in GPU_SERVICES' order)."""
    shared = {(a, b): sorted(set(ids[a]) & set(ids[b]), key=int)
              for i, a in enumerate(GPU_SERVICES) for b in GPU_SERVICES[i + 1:] if a in ids and b in ids}
    return {pair: gpus for pair, gpus in shared.items() if gpus}


def _two_owners(shared: dict[tuple[str, str], list[str]], settings) -> tuple[str, str]:
    (a, b), gpus = next(iter(shared.items()))
    return (f"EYRIE_{a.upper()}_GPU_IDS and EYRIE_{b.upper()}_GPU_IDS share GPU {','.join(gpus)}, "
            f"and nothing runs them one at a time (EYRIE_GPU_SCHEDULER={settings.gpu_scheduler} "
            "grants every stage its GPUs at once): two owners of one GPU.",
            "give each service its own GPUs in .env, or EYRIE_GPU_SCHEDULER=redis (the GPU lease "
            "sequences serve, extract and train on one host).")


def refuse(p: Plan) -> None:
    """What --plan found that would stop the run after GPU work has started: refused now."""
    refusals = ([p.support["refusal"]] if p.support["refusal"] else []) + p.refusals
    if refusals:
        fixes = [fix.rstrip(".") for _, fix in refusals]
        raise EyrieError(" ".join(problem for problem, _ in refusals), "; and ".join(fixes) + ".")


def budget_verdict(p: Plan) -> str:
    """The upper bound, then the expected bytes (at plan.mean_tokens), against extract.budget."""
    if p.all_states_fit:
        return "the upper bound fits"
    per_1k = p.per_1k_tokens_per_sample[p.dtype]
    mean_fits = int(1000 * p.budget_bytes / per_1k)
    verdict = f"the upper bound does NOT fit; it fits while samples average at most {mean_fits:,} tokens"
    expected, mean = p.hidden_states_bytes_expected, p.stored_mean_tokens
    if expected is None:
        return verdict + " (set plan.mean_tokens for the expected bytes; extract refuses before any forward pass " \
                         "if the real ones do not fit)"
    if p.all_states_fit_expected:
        return verdict + (f"; expected {human(expected)} at {mean:,} tokens a sample: fits (extract refuses before "
                          "any forward pass if the real samples are longer)")
    s = p.storage
    if s.chosen in ON_DEMAND and s.modes[s.chosen].fits:
        kept = s.modes[s.chosen].stored_fraction
        return verdict + (f"; expected {human(expected)} at {mean:,} tokens a sample: does NOT fit in full: "
                          f"extract.storage {s.chosen} stores {kept:.1%} of the samples' states "
                          "(storage modes below)")
    return verdict + f"; expected {human(expected)} at {mean:,} tokens a sample: does NOT fit (refused below)"


def gpu_lines(p: Plan) -> list[str]:
    g = p.gpus
    if not g.ids:
        return [f"  GPUs: serve needs {g.serve_gpus} of inference's (the vLLM extraction server and the verifier "
                "use the same); the stack's split is not set here (EYRIE_INFERENCE_GPU_IDS, EYRIE_EXTRACTOR_GPU_IDS, "
                "EYRIE_TRAINER_GPU_IDS)"]
    given = ", ".join(f"{name} {','.join(ids)}" for name, ids in g.ids.items())
    lines = [f"  GPUs: {given}; serve needs {g.serve_gpus} on inference's"]
    if g.shared:
        pairs = "; ".join(f"{pair.replace('+', ' and ')} share {','.join(gpus)}" for pair, gpus in g.shared.items())
        lines.append(f"    {pairs}: " + ("the GPU lease gives each of them one holder at a time" if g.sequenced else
                                         "nothing runs them one at a time (refused below)"))
    return lines + _beside_lines(p)


def _beside_lines(p: Plan) -> list[str]:
    """hybrid and online with the trainer on a GPU of the service's: how the two share it."""
    s = p.storage
    g = s.gpu_sharing
    if s.chosen not in ON_DEMAND or not g.trainer_on_service_gpus or g.utilization_for_both is None:
        return []
    return [f"    in {s.chosen} the extraction service runs at --gpu-memory-utilization "
            f"{g.utilization_for_both:.2f} on inference's GPUs with the trainer on GPU "
            f"{','.join(g.trainer_on_service_gpus)} beside it (their GPU leases share it; GPU memory below)"]
