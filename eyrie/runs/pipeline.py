"""One pipeline per run: the run config (eyrie.stages.run_config) kept in the store, and `advance`,
which starts each stage by itself once the one before is done (called when any task finishes, and
by `eyrie run` itself; every start is idempotent, so calling it twice does nothing twice)."""

from __future__ import annotations

from collections import Counter

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie.core.run_config import RunConfigBase, ServeSection, with_absolute_paths
from eyrie.data.manifest import Layout, config_key, load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs.identity import differing_inputs, located, refuse_other_target, relocate
from eyrie.runs.restart import on_planned
from eyrie.runs.reuse import record_states
from eyrie.stages import PIPELINE, RunView, check_stage_names, run_stages
from eyrie.stages.base import PipelineStage, state_of
from eyrie.stages.run_config import run_config_model, stored_config
from eyrie.work import keys
from eyrie.work.cancel import block
from eyrie.work.queue import job_state, live_tasks


def save_config(conn, store, config: RunConfigBase) -> None:
    """The run's config is kept; a rerun continues the run and may change only the sections of
    stages not yet planned (e.g. extract.budget after a refusal). Its relative paths are made
    absolute where they lie here (with_absolute_paths), the one way for every stored config; a
    planned run given its target and dataset at another path (the same content) reads them there."""
    config = with_absolute_paths(config)
    check_config(store, config)
    kept = stored_config(store, config.run)
    config = located(kept, config) if kept is not None else config
    if store.exists(Layout(config.run).manifest):
        relocate(store, load_run_manifest(store, config.run), config)
    # the settings as given: a field not given stays so (generate's take the planning worker's EYRIE_<FIELD>)
    store.put_json(config_key(config.run), config.model_dump(exclude_unset=True))
    conn.sadd(keys.ACTIVE_PIPELINES, config.run)


def stage_config(settings, store, run: str, stage: PipelineStage, section, dataset=None, body=None,
                 served=None) -> RunConfigBase:
    """A stage started alone (`eyrie generate|extract|train`, POST /runs?stage=) is a run whose kept
    config names it: the config the run has, with the stage's settings (and the stage added to its
    stages, where it names some) and every other section `body` (POST /runs' config) gives, else a
    new one of that stage alone: `body`, or the target named on this host (EYRIE_MODEL, --model) or
    else the one `served` (the inference server's endpoint) and how it is served from the host's
    settings (EYRIE_VLLM_ARGS); for a run planned without a config, from its manifest."""
    kept = stored_config(store, run)
    if kept is None:
        kept = _config_of_manifest(settings, store, run, stage) if store.exists(Layout(run).manifest) else None
        if kept is None:  # a new run: generate's (the stage with a dataset)
            new = body or run_config_model()(run=run, target={"model": _named_target(settings, served)},
                                              dataset=dataset, serve=ServeSection.of_host(settings))
            return new.model_copy(update={"stages": [stage.name], stage.own_section(): section,
                                          **({"dataset": dataset} if dataset is not None else {})})
    own = stage.own_section()
    if body is not None:  # what the body gives is kept (or refused by check_config), never dropped
        kept = kept.model_copy(update={name: getattr(body, name) for name in body.model_fields_set
                                       if name not in ("run", "stages", own, "dataset")})
    planned = own not in _open_sections(store, run)
    # a planned stage's rerun continues its plan: the settings given over the kept ones (start_checks
    # refused any that differ from the plan); before it is planned, the settings given are its settings
    update = {own: type(section).model_validate({**getattr(kept, own).given(), **section.given()}) if planned
              else section}
    if dataset is not None and "dataset" in stage.sections:
        update["dataset"] = type(dataset).model_validate({**kept.dataset.given(), **dataset.given()}) if planned \
            else dataset
    if kept.stages is not None:
        update["stages"] = [s.name for s in PIPELINE if s.name in kept.stages or s is stage]
    return kept.model_copy(update=update)


def _named_target(settings, served) -> str:
    """A new stage-alone run's target: the one named on this host, else the one the inference server
    serves; never the code's default path."""
    if "model" in settings.model_fields_set:
        return settings.model
    if served is not None:
        return served.model
    raise EyrieError("no target named, and no inference server eyrie runs serves one to take as the target (a "
                     "server at EYRIE_INFERENCE_URL does not say which model it is).",
                     "name the target (EYRIE_MODEL, or the run config's target.model), or start its server first "
                     "(`eyrie serve --model M`; in the stack the inference service).")


def _config_of_manifest(settings, store, run: str, stage: PipelineStage) -> RunConfigBase:
    """The config of a run planned before stages started alone kept one (or on another run's states
    with none): its target and dataset as its manifest recorded them; no stage of it ran under it."""
    manifest = load_run_manifest(store, run)
    ref = manifest.dataset
    dataset = {"source": ref.source, "split": ref.split, "revision": ref.revision if ref.kind == "hf" else None,
               "limit": (ref.row_end - ref.row_start) or None}
    serve = ServeSection.of_host(settings).model_copy(update={"trust_remote_code": manifest.target.trust_remote_code})
    return run_config_model()(run=run, stages=[stage.name], target={"model": manifest.target.model}, dataset=dataset,
                              serve=serve)


def check_config(store, config: RunConfigBase) -> None:
    """save_config's refusal, writing nothing: a kept config differs in a planned stage's section
    (its target and dataset compared by content: the same at another path is the same run), or the
    planned run's target no longer has the content it was made with."""
    check_stage_names(config)
    kept = stored_config(store, config.run)
    if kept is None:
        return
    config = with_absolute_paths(config)
    open_sections = _open_sections(store, config.run)
    changed = sorted(k for k in run_config_model().model_fields if getattr(kept, k) != getattr(config, k))
    frozen = [k for k in changed if k not in open_sections]
    manifest = load_run_manifest(store, config.run) if store.exists(Layout(config.run).manifest) else None
    if manifest is not None:
        frozen = differing_inputs(kept, config, manifest, frozen)
    if frozen:
        raise EyrieError(f"run {config.run} was started with another config (differs in: {', '.join(frozen)}, "
                         "of stages already planned).",
                         "rerun with the original config to continue it, or give the new one another run name.")
    if manifest is not None and "target" not in open_sections:
        refuse_other_target(manifest, config.target.model)


def _open_sections(store, run: str) -> set[str]:
    if not store.exists(Layout(run).manifest):
        return set(run_config_model().model_fields)
    view = RunView(None, store, run, None, load_run_manifest(store, run))
    # how the target is served changes nothing the run records (a restart with more GPUs, say); a run
    # of some stages may go on as a whole pipeline (`eyrie run` after `eyrie generate`)
    return {"serve", "plan", "stages"} | {name for stage in PIPELINE if not stage.planned(view) for name in stage.sections}


def run_view(conn, store, run: str) -> RunView:
    """The run as its stages read it (its manifest None before it is planned)."""
    manifest = load_run_manifest(store, run) if store.exists(Layout(run).manifest) else None
    return RunView(conn, store, run, stored_config(store, run), manifest)


def advance(conn, store, run: str) -> str | None:
    """Start the next stage of the run's pipeline if the one before is done; returns its name."""
    if stored_config(store, run) is None:
        return None
    with conn.lock(keys.advance_lock(run), timeout=300, blocking_timeout=300):
        return _next_stage(run_view(conn, store, run))


def _next_stage(view: RunView) -> str | None:
    for stage in run_stages(view.config):
        if stage.done(view):
            if stage.makes_states:
                record_states(view)  # findable by a later run with the same settings (eyrie.runs.reuse)
            continue
        started = stage.start(view)  # idempotent: its planner, or what is missing
        if stage.done(view):  # done at its start (verify skipped, with the reason recorded)
            continue
        return stage.name if started else None
    view.conn.srem(keys.ACTIVE_PIPELINES, view.run)  # its last stage done (exported and verified): the run is done
    return None


def drained_run(conn, store) -> str | None:
    """A pipeline whose generation has drained (no generate task queued, scheduled or running, so
    no request in flight) while its later stages still wait: the server may stop and hand over
    the GPUs. None while anything is generating."""
    first = PIPELINE[0]
    if live_tasks(conn, first.queue):
        return None
    for run in sorted(m.decode() for m in conn.smembers(keys.ACTIVE_PIPELINES)):
        if not store.exists(Layout(run).manifest):
            continue
        view = run_view(conn, store, run)
        if first.done(view) and not all(s.done(view) for s in run_stages(view.config)) and not _stalled(view):
            return run
    return None


def can_go_on(conn, store, run: str, stage: PipelineStage) -> bool:
    """Whether the run's `stage` can still go on, and so needs the server it reads (the inference
    server generate's, the vLLM extraction server extract's or an on-demand training's): its
    pipeline active, not cancelled or blocked (those wait for a person), and the stage neither
    finished nor failed for good (status's own reading: no task of its work left live and one
    failed, or its planning failed or refused). `eyrie retry` or a rerun makes a failed one go on."""
    if not conn.sismember(keys.ACTIVE_PIPELINES, run) or conn.exists(keys.blocked(run), keys.cancelled(run)):
        return False
    view = run_view(conn, store, run)
    if not stage.planned(view):
        planning = job_state(conn, stage.planner.task_id(run)) if stage.planner else None
        return planning != "failed" and stage.refused(view) is None
    left = stage.tasks_left(view)
    jobs = Counter(job_state(conn, task) or "missing" for task in left)
    return bool(left) and state_of(0, len(left), jobs) != "failed"


def _stalled(view: RunView) -> bool:
    """Blocked, cancelled or with a task of a later stage failed for good (verify's included: a
    run whose verify failed is not waiting for the inference GPUs either): its later stages wait
    for a person (`eyrie retry`), not for the GPUs, so a restarted inference service need not
    stay down for it."""
    if view.conn.exists(keys.blocked(view.run), keys.cancelled(view.run)):
        return True
    later = [job for stage in PIPELINE[1:] for job in stage.task_ids(view)]
    return any(job_state(view.conn, job_id) == "failed" for job_id in later)


def run_job_ids(store, run: str) -> dict[str, list[str]]:
    """Every task id the run may have, by queue (raises UnknownRun for an unknown run)."""
    view = RunView(None, store, run, stored_config(store, run), load_run_manifest(store, run))
    ids: dict[str, list[str]] = {}
    for stage in PIPELINE:
        for job in stage.task_ids(view):
            ids.setdefault(stage.queue, []).append(job)
    return ids


def on_task_done(job, connection, result, *args, **kwargs) -> None:
    """RQ's on_success callback of every task: move the run's pipeline on."""
    run = (job.args[0] or {}).get("run") if job.args else None
    if run:
        store = open_store(load_settings())
        # a cancelled run started again: its next planning task, or its cancel lifted (eyrie.runs.restart)
        if on_planned(connection, run, job.id, result) and stored_config(store, run) is not None:
            connection.sadd(keys.ACTIVE_PIPELINES, run)  # a pipeline goes on, as after `eyrie retry`
        advance_or_record(connection, store, run)


def advance_or_record(conn, store, run: str, retry_blocked: bool = False) -> str | None:
    """advance, unless a refusal blocks the run (only `eyrie run`, the user's rerun, retries it)."""
    if conn.exists(keys.cancelled(run)):
        return None  # cancelled: nothing more starts until `eyrie retry` or `eyrie run`
    if retry_blocked:
        conn.delete(keys.blocked(run))
    elif conn.exists(keys.blocked(run)):
        return None
    try:
        return advance(conn, store, run)
    except EyrieError as exc:
        block(conn, run, exc)
        return None
