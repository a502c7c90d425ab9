"""The `eyrie` commands of the pipeline as a whole: a stage's worker, a run's status, `eyrie run`
(with `--plan`) and the demo."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import orjson
import typer

from eyrie.commands.cli_app import app, command, context, follow
from eyrie.core.errors import EyrieError


@app.command()
@command
def worker(stage: str = typer.Argument(..., help="generate | extract | train | verify"),
           burst: bool = typer.Option(False, "--burst", help="Exit when the queue is empty.")):
    """Take tasks of one stage from the queue (any number of workers, on any host)."""
    from eyrie.core.config import load_settings
    from eyrie.core.vllm import available
    from eyrie.stages import on_queue_stages, preload, queues
    from eyrie.work.disk import start_reporting
    from eyrie.work.queue import connect
    from eyrie.work.worker_loop import run_worker

    if stage not in queues():
        raise EyrieError(f"unknown stage {stage!r} for a worker.", f"use: eyrie worker {'|'.join(queues())}")
    settings, stages = load_settings(), on_queue_stages(stage)
    if any(s.needs_vllm for s in stages) and not available(settings.vllm_command):
        # a verify worker announces that runs may verify here: it must be able to
        raise EyrieError(f"a verify worker needs vLLM, and {settings.vllm_command!r} is not here.",
                         "run it where vLLM is installed (the inference image), or set EYRIE_VLLM_COMMAND to "
                         "vLLM's executable or a Python that has it.")
    preload(stage)
    conn = connect(settings.redis_url, wait_s=settings.redis_wait_s)  # a worker starting waits for its Redis
    if any(s.reports_cache for s in stages):  # its local copy of the hidden states: --plan reads the free space
        # on a client of its own: RQ tunes the worker's connections for its blocking dequeue
        start_reporting(connect(settings.redis_url, wait_s=settings.redis_wait_s), stage, settings.cache_dir)
    run_worker(conn, stage, burst)


@app.command()
@command
def status(run: str = typer.Argument(..., help="Run name."),
           as_json: bool = typer.Option(False, "--json", help="One JSON object.")):
    """Per-stage state, counts, throughput and ETA of a run."""
    from eyrie.commands.display import render_status
    from eyrie.runs.status import run_status

    _, conn, store = context()
    result = run_status(conn, store, run)
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
    else:
        render_status(result)


@app.command("run")
@command
def run_pipeline(config: Path = typer.Option(..., "--config", help="The pipeline: run.yaml (examples/)."),
                 plan: bool = typer.Option(False, "--plan", help="Print the storage projection only "
                                                                  "(no server, no GPU, no download)."),
                 wait: bool = typer.Option(False, "--wait", help="Follow every stage until the drafter is exported "
                                                                 "and verified (or verify skipped, with why)."),
                 as_json: bool = typer.Option(False, "--json", help="With --plan: the plan as one JSON object.")):
    """Start (or continue) a whole pipeline: generate -> extract -> train -> evaluate -> export -> verify,
    each stage starting by itself when the one before is done."""
    from eyrie.core.config import load_settings
    from eyrie.core.support import refuse_unsupported_config
    from eyrie.stages.run_config import load_config

    cfg = load_config(config)
    if plan:
        return _print_plan(cfg, load_settings(), as_json)
    refuse_unsupported_config(cfg)  # before Redis is even reached
    from eyrie.data.store import open_store
    from eyrie.runs.control import pipeline_started, start_and_plan
    from eyrie.work.queue import connect

    settings = load_settings(model=cfg.target.model)
    conn, store = connect(settings.redis_url), open_store(settings)
    typer.echo(pipeline_started(start_and_plan(settings, conn, store, cfg)))
    if wait:  # until its last stage with a status of its own is done (the drafter verified, or verify skipped)
        from eyrie.stages import PIPELINE

        follow(conn, store, cfg.run, [s for s in PIPELINE if s.shown][-1].name)


def _print_plan(cfg, settings, as_json: bool) -> None:
    """`eyrie run --plan`: the plan as text, or with `--json` its fields in order; then what it refuses."""
    from eyrie.runs.plan_checks import refuse
    from eyrie.runs.plan_lines import render
    from eyrie.runs.projection import project

    projection = project(cfg, settings)
    typer.echo(orjson.dumps(projection, option=orjson.OPT_INDENT_2).decode() if as_json
               else "\n".join(render(projection)))
    refuse(projection)  # vLLM support, expected bytes over the budget, GPUs: before any GPU work


@app.command()
@command
def demo(run: str = typer.Option("demo", help="Run name (the config's is replaced)."),
         dataset: Optional[str] = typer.Option(None, help="Prompt dataset (default: the config's)."),
         config: Path = typer.Option(Path("examples/run.tiny.yaml"), "--config", help="The pipeline.")):
    """`eyrie run` of the tiny pipeline on the embedded default: the server and the workers as
    local processes, on the CPU, until the drafter is exported (and verified where vLLM runs)."""
    from eyrie.commands.embedded import run_demo

    raise typer.Exit(run_demo(config, run, dataset))
