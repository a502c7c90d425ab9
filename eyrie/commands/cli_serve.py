"""The `eyrie` commands that serve the target: `serve` (its OpenAI server) and `serve-extract` (the
stack's vLLM extraction server)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eyrie.commands.cli_app import app, command
from eyrie.core.errors import EyrieError
from eyrie.stages import entry  # entry: services' code by name (eyrie/ imports none)


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
