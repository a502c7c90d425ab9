"""Control of runs, shared by the CLI and the API: start a pipeline, list, cancel, retry, errors."""

from __future__ import annotations

import logging

from rq import Worker
from rq.command import send_command
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from eyrie.core.errors import EyrieError, UnknownRun
from eyrie.core.run_config import check_run_name
from eyrie.core.support import refuse_unsupported_config
from eyrie.data.manifest import Layout, RunManifest, config_key, load_run_manifest, now_iso
from eyrie.runs.from_answers import answers_of, plan_from_answers
from eyrie.runs.pipeline import advance_or_record, check_config, run_job_ids, run_view, save_config, stage_config
from eyrie.runs.projection import refuse_before_start
from eyrie.runs.restart import hold_cancel, pending
from eyrie.runs.reuse import check_train_as, owner_of, train_on_states
from eyrie.runs.status import overall_state, run_status
from eyrie.stages import PIPELINE, queues, run_stages, stage, startable
from eyrie.stages.base import Started
from eyrie.stages.run_config import stored_config
from eyrie.stages.train import Train
from eyrie.work import inference, keys
from eyrie.work.planning import await_planning
from eyrie.work.queue import EyrieJob, enqueue, enqueue_task, job_errors, job_state, queue
from eyrie.work.status_models import RunSummary, StageSummary

log = logging.getLogger("eyrie.runs.control")

WAITING = {JobStatus.QUEUED.value, JobStatus.SCHEDULED.value, JobStatus.DEFERRED.value}


def start_pipeline(settings, conn, store, cfg, states: RunManifest | None = None) -> dict:
    """What `eyrie run` does (and POST /runs, and `eyrie demo`): check the config at once, keep it,
    enqueue the first stage's planning task (generate: the dataset read on its own queue) and what
    each stage starts ahead (the base drafter's fetch), then let `advance` start whatever stage is
    next. A rerun continues. Returns at once: `start_and_plan` also waits for the planning.
    A new run whose target, dataset, generate and extract settings equal an earlier run's (or
    `states`: the run `eyrie train --as` names) trains on that run's answers and hidden states: it
    starts at train, with nothing generated or extracted (eyrie.runs.reuse). One whose dataset is a
    published answers set for its target starts at extract (eyrie.runs.from_answers)."""
    first = PIPELINE[0]
    # every refusal before anything is written: a refused rerun leaves the run as it was
    refuse_unsupported_config(cfg)  # a run the pinned vLLM cannot carry: refused before anything starts
    refuse_before_start(cfg, settings)  # what --plan refuses: expected bytes over the budget, too few GPUs
    check_config(store, cfg)
    planned = load_run_manifest(store, cfg.run) if store.exists(Layout(cfg.run).manifest) else None
    answers = None if planned or states else answers_of(cfg)  # a published answers set: its target checked
    # an earlier run's states with the same settings as used are found by generate's planner, where
    # the generator host's defaults resolve them (eyrie_generator.plan); here only `eyrie train --as`'s
    reuse = None if planned or answers else states
    plans = reuse is None and answers is None and not (planned and (planned.states_from or planned.answers_from))
    if plans:
        first.check_start(store, cfg.run, first.settings_in(cfg), cfg.dataset)
    save_config(conn, store, cfg)
    conn.delete(keys.blocked(cfg.run))  # the user's rerun retries a refusal
    if reuse is not None:
        planned = train_on_states(store, reuse, cfg.run)
    if answers is not None:
        planned = plan_from_answers(store, cfg.run, answers, cfg.target.model, cfg.target.hub_id)
    if reuse is not None or answers is not None:
        conn.sadd(keys.RUNS, cfg.run)
    view = run_view(conn, store, cfg.run)
    ahead = [kind for each in PIPELINE for kind in each.pipeline_start_tasks(view)]
    # a cancelled run's cancel stays until these have planned, one after another (eyrie.runs.restart)
    if hold_cancel(conn, cfg.run, ahead + ([first.planner] if plans else [])):
        conn.srem(keys.ACTIVE_PIPELINES, cfg.run)  # active again once its cancel is lifted
        enqueue(conn, pending(conn, cfg.run)[0], {"run": cfg.run}, at_front=True)
    else:
        _plan_first(settings, conn, store, cfg, plans)
        for each in PIPELINE:
            each.on_pipeline_start(view)
    stage = advance_or_record(conn, store, cfg.run)
    return {"run": cfg.run, "planning": first.planner.task_id(cfg.run) if plans else None,
            "started": stage, "states_from": planned.states_from if planned else None,
            "answers_from": planned.answers_from["where"] if planned and planned.answers_from else None}


def _plan_first(settings, conn, store, cfg, plans: bool) -> None:
    """The first stage planned (again, on a rerun), where the run is to plan (not on another run's states)."""
    if not plans:
        return
    try:
        PIPELINE[0].plan(run_view(conn, store, cfg.run))
    except EyrieError:
        _forget_unstarted(conn, store, cfg.run)
        raise


def start_and_plan(settings, conn, store, cfg) -> dict:
    """start_pipeline, then its planning task's result: the rows planned and the tasks enqueued."""
    out = start_pipeline(settings, conn, store, cfg)
    first = PIPELINE[0].planner
    for kind in pending(conn, cfg.run):  # a cancelled run's start: what plans before the first stage's planner
        if kind != first:
            await_planning(conn, kind, cfg.run)
    planning = first if out["planning"] else None  # none where it trains on another run's states
    started = await_planned(conn, store, cfg.run, Started(planning=planning))
    manifest = started.manifest or load_run_manifest(store, cfg.run)
    if manifest.states_from and not out["states_from"]:  # generate's planner found an earlier run's states
        out["started"] = _first_not_done(run_view(conn, store, cfg.run))
    return {**out, "rows": manifest.dataset.row_end - manifest.dataset.row_start, "enqueued": started.enqueued,
            "states_from": manifest.states_from}


def _first_not_done(view) -> str | None:
    return next((each.name for each in run_stages(view.config) if not each.done(view)), None)


def train_as(settings, conn, store, source_run: str, run: str, request) -> dict:
    """`eyrie train --run A --as B --lr ...`: run B trains on A's answers and hidden states, with
    A's train settings and those given. B is a pipeline (evaluated, exported and verified as
    usual) where A was one; else B's train stage alone, as A's was."""
    check_run_name(run)
    source = load_run_manifest(store, source_run)
    check_train_as(store, source, run)
    config = stored_config(store, source_run)
    if config is not None:
        section = Train().settings_in(config)
        train = type(request).model_validate({**section.given(), **request.given()})
        stages = None if config.stages is None else [Train.name]  # a pipeline where A was one, else train alone
        out = start_pipeline(settings, conn, store,
                             config.model_copy(update={"run": run, Train.own_section(): train, "stages": stages}), source)
    else:
        if not store.exists(Layout(run).manifest):
            train_on_states(store, source, run)
            conn.sadd(keys.RUNS, run)
        await_planned(conn, store, run, start_stage(settings, conn, store, run, Train.name, request))  # planned
        out = {"run": run, "planning": Train.planner.task_id(run), "started": Train.name,
               "states_from": owner_of(store, source).run}
    manifest = load_run_manifest(store, run)
    return {**out, "rows": manifest.dataset.row_end - manifest.dataset.row_start, "enqueued": 0}


def await_planned(conn, store, run: str, started: Started) -> Started:
    """A stage whose planning task was enqueued, once planned (its refusal raised)."""
    if started.planning is None:
        return started
    result = await_planning(conn, started.planning, run)
    return Started(load_run_manifest(store, run), result.get("enqueued", 0))


def pipeline_started(out: dict) -> str:
    """The line `eyrie run` (and `eyrie demo`) prints for what start_and_plan returned."""
    if out.get("answers_from"):
        return (f"run {out['run']}: starts at extraction on the answers in {out['answers_from']} ({out['rows']} "
                "prompt rows; the same target): nothing is generated; " + (f"{out['started']} started" if out["started"]
                                                                    else "stages follow by themselves"))
    if out.get("states_from"):
        return (f"run {out['run']}: trains on run {out['states_from']}'s generated answers and hidden states "
                f"({out['rows']} rows; the same target, dataset, generate and extract settings): nothing is "
                "generated or extracted again; " + (f"{out['started']} started" if out["started"] else
                                                     "stages follow by themselves"))
    return (f"run {out['run']}: {out['rows']} rows; {out['enqueued']} {PIPELINE[0].name} tasks enqueued now; "
            + (f"{out['started']} started" if out["started"] else "stages follow by themselves"))


def _forget_unstarted(conn, store, run: str) -> None:
    """A first start that failed (e.g. no such dataset) leaves no active pipeline behind."""
    if not store.exists(Layout(run).manifest):
        conn.srem(keys.ACTIVE_PIPELINES, run)
        store.delete(config_key(run))


def start_stage(settings, conn, store, run: str, name: str, section, dataset=None, body=None) -> Started:
    """One stage on its own (`eyrie generate|extract|train`, POST /runs?stage=), from its section
    of a run config (generate also reads `dataset`; POST /runs gives its whole config, `body`): the
    run's config kept names that stage (a pipeline of it alone, eyrie.runs.pipeline.stage_config), so
    nothing starts after it by itself. Its planning task is enqueued on its queue: `await_planned`
    waits for it."""
    if name not in startable():
        raise EyrieError(f"no stage {name!r} to start on its own.", f"start one of: {', '.join(startable())}.")
    chosen = stage(name)
    chosen.check_start(store, run, section, dataset)  # its refusals known at once, before anything is written
    served = inference.read(conn) if body is None and "model" not in settings.model_fields_set else None
    save_config(conn, store, stage_config(settings, store, run, chosen, section, dataset, body, served))
    conn.delete(keys.blocked(run))  # the user's start retries a refusal
    # what only planning knows (the budget, a base drafter) its planning task refuses: the run blocked,
    # and a cancelled one still cancelled (its cancel is lifted once it has planned: eyrie.runs.restart)
    hold_cancel(conn, run, [chosen.planner])
    chosen.plan(run_view(conn, store, run))
    return Started(planning=chosen.planner)


def run_names(conn) -> list[str]:
    return sorted(m.decode() for m in conn.sunion(keys.RUNS, keys.ACTIVE_PIPELINES))


def list_runs(conn, store) -> list[RunSummary]:
    """One line per run: its stages' states and progress, whether it is active, blocked, cancelled."""
    runs = []
    for name in run_names(conn):
        try:
            status = run_status(conn, store, name)
        except UnknownRun:
            continue  # started but its manifest is not written yet, or deleted from the store
        summary_fields = set(StageSummary.model_fields)
        runs.append(RunSummary(
            run=name, created_at=status.created_at, target=status.target.get("model"), state=overall_state(status),
            active=conn.sismember(keys.ACTIVE_PIPELINES, name),
            blocked=status.pipeline.blocked if status.pipeline else None, cancelled=status.cancelled,
            stages={k: StageSummary(**s.model_dump(include=summary_fields)) for k, s in status.stages.items()}))
    return runs


def cancel_run(conn, store, run: str) -> dict:
    """Mark the run cancelled (advance starts nothing more), cancel its waiting tasks, then ask
    the workers running its tasks to stop them (generate's forked tasks stop at once; extract and
    train run in the worker process itself and stop at their next batch or step, within seconds,
    the trainer after saving a checkpoint)."""
    ids = {j for stage_ids in run_job_ids(store, run).values() for j in stage_ids}
    conn.set(keys.cancelled(run), now_iso())
    conn.delete(keys.restarting(run))  # a start still planning is cancelled too
    conn.srem(keys.ACTIVE_PIPELINES, run)
    cancelled = [job_id for job_id in sorted(ids) if _cancel_waiting(conn, job_id)]
    stopped = _stop_running(conn, ids)
    cancelled += _cancel_taken_on(conn, ids - set(stopped))
    return {"run": run, "cancelled": sorted(cancelled), "stopped": stopped}


def _cancel_waiting(conn, job_id: str) -> bool:
    if job_state(conn, job_id) not in WAITING:
        return False
    try:
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).cancel()
    except InvalidJobOperation:  # cancelled meanwhile
        return False
    return True


def _cancel_taken_on(conn, ids: set[str]) -> list[str]:
    """Started tasks that no worker runs as its own: generate shards a stopped task had taken on
    (eyrie_generator.chain), or a dead worker's. They stop with it; `retry` requeues them."""
    taken_on = []
    for job_id in sorted(ids):
        if job_state(conn, job_id) == JobStatus.STARTED.value:
            try:
                Job.fetch(job_id, connection=conn, serializer=JSONSerializer).cancel()
            except InvalidJobOperation:
                continue
            taken_on.append(job_id)
    return taken_on


def _stop_running(conn, ids: set[str]) -> list[str]:
    """By the workers' own current job (a task a worker took while we cancelled is stopped too)."""
    stopped = []
    for name in queues():
        for worker in Worker.all(queue=queue(conn, name), serializer=JSONSerializer):
            job_id = worker.get_current_job_id()
            if job_id in ids:
                send_command(conn, worker.name, "stop-job", job_id=job_id)
                stopped.append(job_id)
    return sorted(stopped)


def retry_run(conn, store, run: str) -> dict:
    """Requeue the run's failed, stopped and cancelled tasks, clear a block or a cancel, and let
    `advance` start whatever stage is next."""
    ids = run_job_ids(store, run)
    conn.delete(keys.cancelled(run), keys.blocked(run), keys.restarting(run))
    requeued = []
    for name in queues():
        q = queue(conn, name)
        for registry in (q.failed_job_registry, q.canceled_job_registry):
            for job_id in set(registry.get_job_ids()) & set(ids.get(name, [])):
                registry.requeue(job_id)
                requeued.append(job_id)
        requeued += _requeue_stopped_by_cancel(conn, name, ids.get(name, []))
    started = None
    if stored_config(store, run) is not None:
        view = run_view(conn, store, run)
        for each in PIPELINE:
            each.on_retry(view)  # a skipped verify decided afresh
        conn.sadd(keys.ACTIVE_PIPELINES, run)
        started = advance_or_record(conn, store, run)
    return {"run": run, "requeued": sorted(requeued), "started": started}


def _requeue_stopped_by_cancel(conn, stage: str, job_ids: list[str]) -> list[str]:
    """Tasks that ended early, cleanly, because of a cancel (their result says `cancelled`)."""
    requeued = []
    for job_id in job_ids:
        if job_state(conn, job_id) != JobStatus.FINISHED.value:
            continue
        job = EyrieJob.fetch(job_id, connection=conn, serializer=JSONSerializer)
        if (job.return_value() or {}).get("status") == "cancelled":
            enqueue_task(conn, stage, job.func_name, job.args[0], job_id, timeout_s=job.timeout)
            requeued.append(job_id)
    return requeued


def recent_errors(conn, store, run: str, limit: int = 20) -> list[str]:
    """The last errors of the run's tasks (most recent first), and a block, if any."""
    ids = [j for stage_ids in run_job_ids(store, run).values() for j in stage_ids]
    blocked = conn.get(keys.blocked(run))
    return ([f"pipeline blocked: {blocked.decode()}"] if blocked else []) + job_errors(conn, ids, limit)
