"""The verify stage: the exported drafter served by vLLM beside the target (its acceptance,
identical outputs), on its own queue, worked where vLLM is. Never skipped in silence: where no
verify worker (or Kubernetes Job) can run it, the run records why and how to enable it."""

from __future__ import annotations

import json
import time

from eyrie.core.config import load_settings
from eyrie.core.run_config import VerifySection
from eyrie.data.verify_outputs import outputs_failure
from eyrie.stages.base import LIVE_JOB_STATES, PipelineStage, RunView, state_of
from eyrie.stages.generate import Generate
from eyrie.work import keys, progress
from eyrie.work.k8s_jobs import load_templates
from eyrie.work.queue import enqueue, job_errors, job_state, workers_on
from eyrie.work.status_models import StageStatus
from eyrie.work.task_kinds import TaskKind

MIN_VERIFY_TOK_S = 5.0  # tokens/s at 1 and at 8 in flight where nothing was measured (no generation, no verify)
BENCHMARK_PROMPTS_BOUND = 1319  # the largest shipped benchmark (GSM8K test)
# A verify worker that stopped this recently counts as this deployment's verifier, restarting (a
# container recreated, a new image): a run exporting meanwhile waits for it instead of skipping
# verify for good. Longer than a restart, short enough that a verifier taken away is soon noticed.
VERIFIER_RESTART_S = 600


class Verify(PipelineStage):
    name = queue = "verify"
    sections = {"verify": VerifySection}
    # its timeout is set at enqueue from the run's plan (verify_timeout_s)
    work = TaskKind("verify", "verify", "eyrie_trainer.verify.run_verify_task", gpu=True, timeout_s=7200,
                    jobs=("verify",))
    worker, needs_vllm = "verifier", True
    # shown: a run is done once verified or skipped with its reason, failed where its task failed
    # (its result also shows under the train stage's, beside the exported drafter)

    def planned(self, view: RunView) -> bool:
        return self.done(view)

    def done(self, view: RunView) -> bool:
        return view.manifest is not None and view.manifest.verify is not None

    def plan(self, view: RunView) -> bool:
        """Decided where the other stages plan (it has no planning task: no verify worker may be up to
        run one): skipped with the reason recorded, or its task enqueued with the time limit its plan
        allows (verify_timeout_s)."""
        if job_state(view.conn, self.work.task_id(view.run)) in LIVE_JOB_STATES:
            # enqueued already (maybe waiting for a restarting verifier): not decided again. RQ lists a task whose
            # verifier was SIGKILLed under it as started for good: enqueue replaces it (its lease lapsed), so a
            # retried or rerun run verifies again instead of waiting on a dead task
            self._enqueue(view)
            return True
        skipped = verify_skipped(view.conn, view.config)
        if skipped is None:
            self._enqueue(view)
            return True
        view.manifest.verify = skipped  # never skipped in silence: the run's status says why and how
        view.store.put_json(view.layout.manifest, view.manifest.model_dump())
        return False

    def _enqueue(self, view: RunView) -> None:
        """Its task, unless a live one is queued or running (eyrie.work.queue.enqueue_task)."""
        enqueue(view.conn, self.work, {"run": view.run}, timeout_s=verify_timeout_s(view.conn, view.config, view.manifest))

    def status(self, view: RunView) -> StageStatus | None:
        """Once the pipeline's drafter is exported (or a verify ran or was asked for by hand):
        pending, in progress, failed with its task's errors or its outputs' verdict, or done
        (verified, or skipped: why and how to verify shows under train)."""
        manifest, job = view.manifest, self.work.task_id(view.run)
        state = job_state(view.conn, job)
        result = manifest.verify if manifest else None
        if result is None and state is None and (not self.in_run(view) or manifest is None or manifest.drafter is None):
            return None
        common = {"total": 1, "workers": workers_on(view.conn, self.queue)}
        if result is not None and state not in LIVE_JOB_STATES:  # (a failed task since verified by hand: done)
            if failure := outputs_failure(result):
                return StageStatus(state="failed", failed=1, errors=[" Fix: ".join(failure)], **common)
            skipped = int(bool(result.get("skipped")))
            return StageStatus(state="done", done=1 - skipped, skipped=skipped, **common)
        jobs = {state or "pending": 1}
        return StageStatus(state=state_of(0, 1, jobs), jobs=jobs, failed=int(state == "failed"),
                           errors=job_errors(view.conn, [job]), **common)

    def on_retry(self, view: RunView) -> None:
        """A skipped verify is decided afresh (a verifier may be up now: the skip's fix says so); one that
        failed on its outputs runs again."""
        verify = view.manifest.verify if view.manifest is not None else None
        if verify and (verify.get("skipped") or outputs_failure(verify)):
            view.manifest.verify = None
            view.store.put_json(view.layout.manifest, view.manifest.model_dump())


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
    if verifier_here(conn):
        return None
    return {"skipped": "no worker of the verify queue is up (it runs where vLLM is installed)",
            "fix": "start one (`eyrie worker verify`; in the Compose stack, the verifier service), then "
                   f"`eyrie retry {config.run}`; set verify.enabled: true to wait for one; or {later}"}


def verifier_here(conn) -> bool:
    """A verify worker is up, or one stopped within VERIFIER_RESTART_S (restarting: the run's
    verify task waits on the queue for it; should it not come back, the run's status says that no
    worker listens, and `eyrie worker verify` or a rerun with verify.enabled: false ends the wait)."""
    if workers_on(conn, Verify.queue):
        return True
    left = conn.get(keys.worker_left(Verify.queue))
    return left is not None and time.time() - float(left) < VERIFIER_RESTART_S


def verify_timeout_s(conn, config, manifest) -> int:
    """The verify task's time budget from its plan: per pass (the target alone, then once per K) a
    vLLM start within the serve deadline and three times what its greedy answers take at verify's
    own pace: every prompt of a set with 8 requests in flight, then its first serial_prompts one at
    a time (verify_rates); benchmark sets counted at their --prompts cap, twice where a set may have second
    turns (MT-Bench, a .jsonl file: each is asked after its first turn)."""
    request = config.verify
    cap = request.prompts or BENCHMARK_PROMPTS_BOUND
    passes_per_set = [2 if may_have_second_turns(name) else 1 for name in request.benchmarks]
    sets = [min(cap, manifest.train.heldout_samples)] + [cap] * sum(passes_per_set)
    answer = request.max_tokens or manifest.generate.sampling.max_tokens
    at_8, at_1 = verify_rates(conn, config.run, manifest)
    seconds = sum(n * answer / at_8 + min(n, request.serial_prompts) * answer / at_1 for n in sets)
    passes = 1 + max(1, len(request.ks))
    return int(passes * (load_settings().serve_deadline_s + 3 * seconds))


def may_have_second_turns(benchmark: str) -> bool:
    """MT-Bench has them; a .jsonl file's rows may (2+ `turns`): eyrie_trainer.benchmarks reads which."""
    return benchmark == "mt-bench" or benchmark.endswith(".jsonl")


def verify_rates(conn, run: str, manifest) -> tuple[float, float]:
    """Tokens/s at 8 and at 1 request in flight: the slowest a verify of the target measured
    (record_verify_rates); else the run's generation per request (its tok/s over its concurrency,
    a request's pace under a load at least verify's) times 8 and 1; else MIN_VERIFY_TOK_S."""
    own = conn.hget(keys.VERIFY_RATES, manifest.target.model)
    if own:
        rates = json.loads(own)
        return rates["8"], rates["1"]
    generated = generate_tok_s(conn, run)
    if generated:
        concurrency = max(1, manifest.generate.concurrency)
        per_request = generated / concurrency
        return per_request * min(8, concurrency), per_request
    return MIN_VERIFY_TOK_S, MIN_VERIFY_TOK_S


def record_verify_rates(conn, target: str, passes: list[dict]) -> None:
    """What a verify measured, per pass ({"8": tok/s, "1": tok/s}): the slowest at each, kept for
    the target's next verify (verify_rates)."""
    slowest = {n: min((p[n] for p in passes if p.get(n)), default=None) for n in ("8", "1")}
    if all(slowest.values()):
        conn.hset(keys.VERIFY_RATES, target, json.dumps({**slowest, "at": time.time()}))
