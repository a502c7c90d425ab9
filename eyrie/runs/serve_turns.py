"""Whose turn it is at the stack's inference service (`eyrie serve --run active`): it serves one
target at a time, the runs whose generation can go on (eyrie.runs.pipeline.can_go_on) in the
order they started (their planning: the manifest's created_at; ties, and runs not planned yet, by
name, after). The run served holds the server until its generation is done or cannot go on; a
later run on the same target is served by it meanwhile, one on another target waits its turn:
its generate tasks hand themselves back (eyrie.work.inference.WaitingTurn), and status names the
run it waits for. `eyrie_inference.server` serves in this order; the generator and status ask who
holds the server."""

from __future__ import annotations

from eyrie.core.target import same_target
from eyrie.data.manifest import Layout, load_run_manifest
from eyrie.runs.pipeline import can_go_on
from eyrie.stages import PIPELINE
from eyrie.stages.run_config import stored_config
from eyrie.work import inference, keys

UP = ("waiting", "starting", "ready")  # an endpoint in one of these states holds the server for its run


def serve_order(conn, store) -> list[str]:
    """The active runs whose generation can go on, in the order the service serves them."""
    runs = [m.decode() for m in conn.smembers(keys.ACTIVE_PIPELINES)]
    return [run for run in sorted(runs, key=lambda run: _started(store, run)) if _generates(conn, store, run)]


def _generates(conn, store, run: str) -> bool:
    return can_go_on(conn, store, run, PIPELINE[0])


def same_server(store, run: str, endpoint, model: str) -> bool:
    """Whether `run`'s target is the one `endpoint` serves (started for the target `model`): by
    its manifest's target as its generate tasks check it, or before it is planned, its config's."""
    if store.exists(Layout(run).manifest):
        return same_target(load_run_manifest(store, run).target, endpoint)
    config = stored_config(store, run)
    return config is not None and config.target.model == model


def _started(store, run: str) -> tuple:
    key = Layout(run).manifest
    created = store.get_json(key).get("created_at") if store.exists(key) else None
    return created is None, created or "", run


def holder(conn, store, run: str, target) -> str | None:
    """The run whose generation holds the stack's inference server while `run` (whose target is
    `target`, its manifest's) waits its turn: the run a published endpoint serves, another one, on
    another target, while that endpoint is up and its run can still generate. None: nothing to
    wait for (the server is for `run`'s target, between runs, or not the stack's service)."""
    for endpoint in inference.read_all(conn):
        if (endpoint.run not in (None, run) and endpoint.state in UP and not same_target(target, endpoint)
                and _generates(conn, store, endpoint.run)):
            return endpoint.run
    return None


def turn_text(held_by: str) -> str:
    """What a run waiting its turn waits for, as status shows it."""
    return (f"its turn at the inference server: run {held_by}'s generation holds it (one target at a time, "
            "runs in the order they started)")
