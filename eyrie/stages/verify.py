"""The verify stage: the exported drafter served by vLLM beside the target (its acceptance,
identical outputs), on its own queue, worked where vLLM is. Never skipped in silence: where no
verify worker (or Kubernetes Job) can run it, the run records why and how to enable it."""

from __future__ import annotations

from eyrie.core.config import load_settings
from eyrie.stages.base import PipelineStage, RunView
from eyrie.stages.generate import Generate
from eyrie.work import progress
from eyrie.work.k8s_jobs import load_templates
from eyrie.work.queue import enqueue, workers_on
from eyrie.work.task_kinds import TaskKind

MIN_VERIFY_TOK_S = 5.0  # tokens/s: a floor where generation measured nothing (e.g. a stub server)
BENCHMARK_PROMPTS_BOUND = 1319  # the largest shipped benchmark (GSM8K test)


class Verify(PipelineStage):
    name = queue = "verify"
    sections = ("verify",)
    # its timeout is set at enqueue from the run's plan (verify_timeout_s)
    work = TaskKind("verify", "verify", "eyrie_trainer.verify.run_verify_task", gpu=True, timeout_s=7200,
                    jobs=("verify",))
    worker, needs_vllm = "verifier", True
    shown = False  # its result is part of the train stage's status (the exported drafter's)

    def planned(self, view: RunView) -> bool:
        return self.done(view)

    def done(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.verify is not None

    def start(self, view: RunView) -> bool:
        skipped = verify_skipped(view.conn, view.config)
        if skipped is None:
            timeout_s = verify_timeout_s(view.conn, view.config, view.manifest)
            enqueue(view.conn, self.work, {"run": view.run}, timeout_s=timeout_s)
            return True
        view.manifest.verify = skipped  # never skipped in silence: the run's status says why and how
        view.store.put_json(view.layout.manifest, view.manifest.model_dump())
        return False

    def status(self, view: RunView):
        return None


def generate_tok_s(conn, run: str) -> float | None:
    """Completion tokens per second over the run's generate stage, as its progress recorded it."""
    entries = progress.read(conn, run, Generate.name).values()
    started = progress.started_at(conn, run, Generate.name)
    tokens, last = sum(e.get("tokens", 0) for e in entries), max((e.get("updated_at", 0) for e in entries), default=0)
    return tokens / (last - started) if started and tokens and last > started else None


def verify_skipped(conn, config) -> dict | None:
    """Why the run's verify stage does not run (None: it runs). By default it runs wherever it can:
    on Kubernetes (a verify Job), or where a worker of the verify queue (which has vLLM) is up."""
    if config.verify.enabled:
        return None
    later = f"later: `eyrie verify --run {config.run}` where vLLM is installed"
    if config.verify.enabled is False:
        return {"skipped": "verify.enabled is false in the run config", "fix": later}
    settings = load_settings()
    if settings.gpu_scheduler == "kueue":
        if Verify.name in load_templates(settings.kueue_jobs_file).get("stages", {}):
            return None
        return {"skipped": "the chart renders no verify Job", "fix": f"set gpuJobs.verify.enabled: true, or {later}"}
    if workers_on(conn, Verify.queue):
        return None
    return {"skipped": "no worker of the verify queue is up (it runs where vLLM is installed)",
            "fix": "start one (`eyrie worker verify`; in the Compose stack, the verifier service) before the "
                   f"run exports, set verify.enabled: true to wait for one, or {later}"}


def verify_timeout_s(conn, config, manifest) -> int:
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
