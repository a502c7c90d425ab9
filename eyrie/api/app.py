"""The API's routes: runs (start, list, status, manifest, failures, what runs now, family, rates, cancel,
retry), health, queues, metrics, dashboard."""

from __future__ import annotations

from pathlib import Path as FilePath
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError

import eyrie
from eyrie import stages
from eyrie.api.auth import can_read, need_token
from eyrie.api.dashboard import running_now, token_rates
from eyrie.api.datasets import check_dataset_source
from eyrie.api.metrics import metrics_response
from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError, UnknownRun
from eyrie.core.run_config import RUN_NAME
from eyrie.data.manifest import load_run_manifest
from eyrie.data.store import open_store
from eyrie.runs import control
from eyrie.runs.audit import audit as audit_run
from eyrie.runs.failures import Reason, failures
from eyrie.runs.family import Family, family
from eyrie.runs.status import run_status
from eyrie.stages import PIPELINE, queues, startable
from eyrie.stages.run_config import run_config_model
from eyrie.work.queue import connect, task_counts
from eyrie.work.status_models import QueueTasks, RunStatus, RunSummary

STATIC = FilePath(__file__).parent / "static"
RunName = Annotated[str, Path(pattern=RUN_NAME.pattern, description="Run name.")]
ERRORS = {401: {"description": "No bearer token."}, 403: {"description": "Wrong token, or none configured."}}
UNKNOWN = {**ERRORS, 404: {"description": "Unknown run."}}
BAD = {**ERRORS, 400: {"description": "A problem the user can fix (`detail` and `fix`)."}}
Stage = Literal[startable()]
QueueName = Literal[queues()]


def create_app(settings=None) -> FastAPI:
    settings = settings or load_settings()
    app = FastAPI(title="eyrie", version=eyrie.__version__,
                  description="Control plane of eyrie: prompts + target LLM -> EAGLE-3 drafter.")
    app.state.settings, app.state.conn, app.state.store = settings, connect(settings.redis_url), open_store(settings)
    app.add_exception_handler(UnknownRun, lambda _, exc: _error(404, exc))
    app.add_exception_handler(EyrieError, lambda _, exc: _error(400, exc))
    app.add_exception_handler(ValidationError, lambda _, exc: _invalid(exc))
    app.include_router(routes())
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _error(status: int, exc: EyrieError) -> JSONResponse:
    return JSONResponse({"detail": exc.problem, "fix": exc.fix}, status_code=status)


def _invalid(exc: ValidationError) -> JSONResponse:
    """A value the body's schema let through but a stage's own model refuses: the user's to fix."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"]} for e in errors],
                         "fix": "change the named values and send the request again."}, status_code=422)


def routes():
    r = APIRouter()

    @r.get("/healthz", tags=["health"])
    def healthz(request: Request) -> JSONResponse:
        """Redis answers (the store is checked when the API starts)."""
        try:
            request.app.state.conn.ping()
        except Exception:
            return JSONResponse({"ok": False, "redis": "unreachable"}, status_code=503)
        return JSONResponse({"ok": True})

    @r.get("/runs", dependencies=[Depends(can_read)], responses=ERRORS, tags=["runs"])
    def list_runs(request: Request) -> list[RunSummary]:
        """Every known run: state, and each stage's state and counts."""
        return control.list_runs(request.app.state.conn, request.app.state.store)

    def start_run(config, request: Request, stage: Stage | None = None) -> dict:
        """Start (or continue) a pipeline: the body is the config `eyrie run --config` takes.
        With `?stage=generate|extract|train`, that stage only (nothing follows by itself)."""
        state = request.app.state
        if "dataset" in (PIPELINE[0] if stage is None else stages.stage(stage)).sections:  # read on this host
            check_dataset_source(config.dataset.source, state.settings.api_dataset_roots)
        settings = state.settings.model_copy(update={"model": config.target.model})
        if stage:
            section = stages.stage(stage).settings_in(config)
            started = control.start_stage(settings, state.conn, state.store, config.run, stage, section, config.dataset,
                                          body=config)
            planning = started.planning.task_id(config.run) if started.planning else None
            return {"run": config.run, "stage": stage, "enqueued": started.enqueued, "planning": planning}
        return control.start_pipeline(settings, state.conn, state.store, config)  # planned by its own task

    start_run.__annotations__["config"] = run_config_model()  # the pipeline's sections as it stands (not a name)
    r.post("/runs", status_code=202, dependencies=[Depends(need_token)], responses=BAD, tags=["runs"])(start_run)

    @r.get("/runs/{name}", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def status(name: RunName, request: Request) -> RunStatus:
        """The same object as `eyrie status NAME --json`."""
        return run_status(request.app.state.conn, request.app.state.store, name)

    @r.get("/runs/{name}/manifest", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def manifest(name: RunName, request: Request) -> dict:
        """The run's provenance manifest, as stored."""
        return load_run_manifest(request.app.state.store, name).model_dump()

    @r.get("/runs/{name}/errors", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def errors(name: RunName, request: Request) -> list[str]:
        """The run's recent errors, most recent first (what `eyrie logs NAME` prints)."""
        return control.recent_errors(request.app.state.conn, request.app.state.store, name)

    @r.get("/runs/{name}/failures", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def failures_by_reason(name: RunName, request: Request) -> list[Reason]:
        """Failed and skipped samples by reason per stage, one example each, samples training left
        out, and failed tasks by error (`eyrie logs NAME` prints the same)."""
        return failures(request.app.state.conn, request.app.state.store, name)

    @r.get("/runs/{name}/now", dependencies=[Depends(can_read)], responses=ERRORS, tags=["runs"])
    def now(name: RunName, request: Request) -> dict:
        """What runs now: the workers on the run's tasks (worker, host, last heartbeat), and every
        worker up."""
        return running_now(request.app.state.conn, request.app.state.store, name)

    @r.get("/runs/{name}/family", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def run_family(name: RunName, request: Request) -> Family:
        """The runs that train on the same generated answers and hidden states as this one (a recipe
        sweep): each one's train settings and acceptance, and which settings vary among them."""
        return family(request.app.state.store, name)

    @r.get("/runs/{name}/rates", dependencies=[Depends(can_read)], responses=ERRORS, tags=["runs"])
    def rates(name: RunName, request: Request) -> dict[str, list[tuple[float, float]]]:
        """Tokens per second per stage over time: [[epoch seconds, tok/s], ...] (from the workers'
        progress reports, kept in Redis)."""
        return token_rates(request.app.state.conn, name)

    @r.get("/runs/{name}/audit", dependencies=[Depends(can_read)], responses=UNKNOWN, tags=["runs"])
    def audit(name: RunName, request: Request) -> list[dict]:
        """Every sample accounted for, read back from the store: per stage in, done, skipped,
        failed, duplicated, lost, pending (what `eyrie audit NAME --json` prints)."""
        return [f.model_dump() for f in audit_run(request.app.state.store, name)]

    @r.post("/runs/{name}/cancel", dependencies=[Depends(need_token)], responses=UNKNOWN, tags=["runs"])
    def cancel(name: RunName, request: Request) -> dict:
        """Remove the run's waiting tasks, stop its running ones; no stage starts after."""
        return control.cancel_run(request.app.state.conn, request.app.state.store, name)

    @r.post("/runs/{name}/retry", dependencies=[Depends(need_token)], responses=UNKNOWN, tags=["runs"])
    def retry(name: RunName, request: Request) -> dict:
        """Requeue the run's failed, stopped and cancelled tasks; clear a block or a cancel."""
        return control.retry_run(request.app.state.conn, request.app.state.store, name)

    @r.get("/queues/{name}", dependencies=[Depends(can_read)], responses=ERRORS, tags=["health"])
    def queue_tasks(name: QueueName, request: Request) -> QueueTasks:
        """A queue's tasks that still need a worker: queued, started (running, so off RQ's list),
        scheduled (a retry's backoff) and deferred. KEDA scales the generator workers on `live`."""
        counts = task_counts(request.app.state.conn, name)
        return QueueTasks(queue=name, **counts, live=sum(counts.values()))

    @r.get("/metrics", dependencies=[Depends(can_read)], responses=ERRORS, tags=["health"],
           response_class=Response)
    def metrics(request: Request) -> Response:
        """Prometheus text format: queues, in flight, samples, tokens, tok/s, bytes, lease, failures."""
        return metrics_response(request.app.state.conn, request.app.state.store)

    @r.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    return r
