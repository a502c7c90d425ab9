"""The control commands of the `eyrie` CLI: api, runs, watch, show, cancel, retry, logs, audit; and publish."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import orjson
import typer

from eyrie.commands.cli_app import app, command, context
from eyrie.core.errors import EyrieError


def _print_json(obj) -> None:
    typer.echo(orjson.dumps(obj, default=lambda model: model.model_dump(mode="json"),
                            option=orjson.OPT_INDENT_2).decode())


@app.command()
@command
def api(host: Optional[str] = typer.Option(None, help="Bind address (EYRIE_API_HOST, default 127.0.0.1)."),
        port: Optional[int] = typer.Option(None, help="Port (EYRIE_API_PORT, default 8080).")):
    """Serve the control API, the dashboard (/) and /metrics."""
    import uvicorn

    from eyrie.api.app import create_app
    from eyrie.core.config import load_settings

    settings = load_settings(api_host=host, api_port=port)
    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port,
                log_level="info", access_log=False)


@app.command()
@command
def runs(as_json: bool = typer.Option(False, "--json", help="One JSON array.")):
    """Every run known to Redis: its state and each stage's progress."""
    from eyrie.commands.display import runs_table
    from eyrie.runs.control import list_runs

    _, conn, store = context()
    listed = list_runs(conn, store)
    if as_json:
        _print_json(listed)
    else:
        runs_table(listed)


@app.command()
@command
def watch(run: str = typer.Argument(..., help="Run name."),
          interval: float = typer.Option(2.0, min=0.2, help="Seconds between refreshes.")):
    """Follow a run live until it is done, failed or cancelled (exit 0, 3, 4)."""
    from eyrie.commands.display import render_status, watch_status
    from eyrie.runs.status import overall_state, run_status

    _, conn, store = context()
    final = watch_status(conn, store, run, interval)
    render_status(run_status(conn, store, run))
    raise typer.Exit({"done": 0, "failed": 3, "cancelled": 4}.get(overall_state(final), 0))


@app.command()
@command
def show(run: str = typer.Argument(..., help="Run name."),
         as_json: bool = typer.Option(False, "--json", help="The manifest as stored.")):
    """The run's provenance manifest: target, dataset, parameters of every stage, the drafter; then
    charts of loss and accuracy per TTT position over the steps, acceptance length per checkpoint
    (eyrie's, vLLM's where verified) and acceptance per draft position."""
    from eyrie.commands.display import render_charts, render_manifest
    from eyrie.data.manifest import load_run_manifest
    from eyrie.stages import RunView
    from eyrie.stages.train import evaluation_of, train_charts

    _, conn, store = context()
    manifest = load_run_manifest(store, run)
    if as_json:
        _print_json(manifest.model_dump())
    else:
        render_manifest(manifest.model_dump())
        view = RunView(conn, store, run, manifest=manifest)
        render_charts(train_charts(view, evaluation_of(view)))


def _on_run(action: str, run: str) -> dict:
    """eyrie.runs.control's `{action}_run` (cancel, retry) on the run, as the API calls it."""
    from eyrie.runs import control

    _, conn, store = context()
    return getattr(control, f"{action}_run")(conn, store, run)


@app.command()
@command
def cancel(run: str = typer.Argument(..., help="Run name.")):
    """Cancel a run: its waiting tasks are removed, running ones stopped, no stage starts after."""
    out = _on_run("cancel", run)
    typer.echo(f"run {run}: cancelled ({len(out['cancelled'])} waiting tasks removed, "
               f"{len(out['stopped'])} running tasks asked to stop); `eyrie retry {run}` resumes it")


@app.command()
@command
def retry(run: str = typer.Argument(..., help="Run name.")):
    """Requeue a run's failed, stopped and cancelled tasks and clear a block or a cancel."""
    out = _on_run("retry", run)
    typer.echo(f"run {run}: {len(out['requeued'])} tasks requeued"
               + (f"; {out['started']} started" if out["started"] else ""))


@app.command()
@command
def logs(run: str = typer.Argument(..., help="Run name."),
         limit: int = typer.Option(20, min=1, help="At most this many errors."),
         as_json: bool = typer.Option(False, "--json", help="One JSON array.")):
    """The run's recent errors, most recent first (and a block, if the run is blocked); then its
    samples failed, skipped or left out of training, by reason per stage, with one example each."""
    from eyrie.runs.control import recent_errors
    from eyrie.runs.failures import failures

    _, conn, store = context()
    errors = recent_errors(conn, store, run, limit)
    if as_json:
        _print_json(errors)
        return
    if not errors:
        typer.echo(f"run {run}: no errors")
    for line in errors:
        typer.echo(line)
    for reason in failures(conn, store, run):
        if reason.kind != "task":  # the task errors are the lines above
            example = reason.example or {}
            row = f", row {example['row']}" if example.get("row") is not None else ""
            where = f" (e.g. sample {example['sample_id']}{row})" if example.get("sample_id") else ""
            typer.echo(f"{reason.stage}: {reason.count} {reason.kind}: {reason.reason}{where}")


@app.command()
@command
def audit(run: str = typer.Argument(..., help="Run name."),
          as_json: bool = typer.Option(False, "--json", help="One JSON array.")):
    """Every sample accounted for, from the store: in, done, skipped, failed, duplicated, lost,
    pending, per stage. Exit code 3 if any sample is lost or duplicated."""
    from eyrie.runs.audit import audit as audit_run
    from eyrie.runs.audit import clean, render

    _, _, store = context()
    figures = audit_run(store, run)
    if as_json:
        _print_json([f.model_dump() for f in figures])
    else:
        for line in render(figures):
            typer.echo(line)
    if not clean(figures):
        raise typer.Exit(3)


@app.command()
@command
def publish(run: str = typer.Option(..., "--run", help="Run name (its drafter exported and verified)."),
            repo: Optional[str] = typer.Option(None, "--repo", help="A model repository OWNER/NAME on the hub "
                                               "(HF_TOKEN, HF_ENDPOINT as huggingface_hub reads them)."),
            to: Optional[Path] = typer.Option(None, "--to", help="Write the same files into this directory "
                                              "(offline or air-gapped hosts)."),
            allow: list[str] = typer.Option([], "--allow", metavar="REFUSAL", help="Publish over this one "
                                            "refusal (repeat for each): unverified, other-checkpoint, outputs-differ, "
                                            "no-drafts; the card names each."),
            license: Optional[str] = typer.Option(None, "--license", metavar="SPDX", help="The target's license, "
                                                  "where this host cannot read its card (e.g. apache-2.0); the card "
                                                  "says the publisher stated it."),
            force: bool = typer.Option(False, "--force", hidden=True),
            public: bool = typer.Option(False, "--public", help="Create the repository public (default: private)."),
            with_answers: bool = typer.Option(False, "--with-answers", help="The run's generated answers too, as a "
                                              "dataset (parquet, token ids, provenance): DIR/answers, and the "
                                              "dataset repository of the same name.")):
    """Share the run's drafter with a model card generated from its manifest: what vLLM measured, the
    data, the recipe, the command that serves it. Publishing what is already there commits nothing."""
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store
    from eyrie.stages import entry

    if force:
        raise EyrieError("--force is gone: each refusal is overridden by its own name.",
                         "pass --allow NAME for each refusal to publish over (unverified, other-checkpoint, "
                         "outputs-differ, no-drafts), and --license SPDX where the target's license is not known here.")
    result = entry("eyrie_trainer.publish.publish")(open_store(load_settings()), run, repo, to, tuple(allow), public,
                                                     with_answers, license)
    if "to" in result:
        changed = result["to"]["changed"]
        typer.echo(f"run {run}: {result['to']['path']}: " + (f"wrote {', '.join(changed)}" if changed
                                                             else "unchanged (it holds these files already)"))
    for key, kind in (("repo", "model"), ("answers", "dataset")):
        if key in result:
            done = result[key]
            typer.echo(f"run {run}: {kind} {repo}: " + (f"commit {done['commit']} ({', '.join(done['changed'])}) "
                                                       f"{done['url']}" if done["commit"]
                                                       else "unchanged (it holds these files already): no commit"))
