"""The `eyrie` commands on a run's trained drafter: evaluate, export, verify, and materialize (its
hidden states in speculators' layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import orjson
import typer

from eyrie.commands.cli_app import app, command, context
from eyrie.commands.cli_options import checked
from eyrie.core.errors import EyrieError
from eyrie.stages import VERIFY, entry  # entry: services' code by name (eyrie/ imports none)


@app.command()
@command
def evaluate(run: str = typer.Option(..., "--run", help="Run name (trained)."),
             device: str = typer.Option("cpu", help="cpu or cuda.")):
    """Simulated acceptance length τ of every checkpoint on the held-out samples (and untrained)."""
    # It runs here rather than enqueue a task and wait: it measures on the device named here (--device,
    # this host's), where no trainer worker need be up; a task would run on a trainer's device. It
    # writes the evaluation record the train task writes (eyrie_trainer.export.evaluate, the same code).
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
    # It runs here rather than enqueue the verify task and wait: it is the fix a skipped verify names
    # (no verify worker is up, or verify.enabled is false), so it must run where vLLM is installed and
    # no worker is. It takes the GPU lease as the task does and records its result in the run manifest
    # the same way (eyrie_trainer.verify.verify, the task's own code).
    from eyrie.core.run_config import VerifySection
    from eyrie.data.manifest import load_run_manifest
    from eyrie.stages.run_config import stored_config
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
