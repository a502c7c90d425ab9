"""The `eyrie` command line's app, which each group's module (eyrie.commands.cli_serve, cli_stages,
cli_drafter, cli_pipeline, cli_control) registers its commands on (each imports this, none another's
commands), the way every command reports an error, a command's context (settings, Redis, the
store) and its `--wait`. Its imports of the rest stand in the functions: `eyrie --help` stays fast."""

from __future__ import annotations

import faulthandler
import functools
import logging
import signal

import click
import typer

from eyrie.core.errors import EyrieError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="eyrie: prompts + target LLM -> EAGLE-3 drafter.")


def command(func):
    """Run a command; a user-fixable error becomes one line on stderr and exit code 1. Anything
    else is a bug of ours: one line too (EYRIE_DEBUG=1 shows the traceback), never a stack trace."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except EyrieError as exc:
            typer.echo(f"eyrie: error: {exc}", err=True)
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, click.ClickException, KeyboardInterrupt):
            raise
        except Exception as exc:
            if _debug():
                raise
            typer.echo(f"eyrie: internal error: {type(exc).__name__}: {exc} Fix: rerun with EYRIE_DEBUG=1 "
                       "for the traceback and report it.", err=True)
            raise typer.Exit(1) from None
    return wrapper


def _debug() -> bool:
    """Settings.debug (EYRIE_DEBUG) read alone: the rest of the configuration may be what failed. A
    value that is not a yes or a no asks for the traceback, as any value did before it was typed."""
    from eyrie.core.config import one_setting

    try:
        return one_setting("debug")
    except EyrieError:
        return True


def context():
    """A command's settings, Redis connection and store."""
    from eyrie.core.config import load_settings
    from eyrie.data.store import open_store
    from eyrie.work.queue import connect

    settings = load_settings()
    return settings, connect(settings.redis_url), open_store(settings)


def follow(conn, store, run: str, stage: str) -> None:
    """`--wait`: the run followed until `stage` ends; its exit code (3 failed, 4 cancelled) unless done."""
    from eyrie.commands.display import follow_stage

    code = follow_stage(conn, store, run, stage)
    if code:
        raise typer.Exit(code)


def set_up_process() -> None:
    """`kill -USR1 <pid>` prints where every thread of an eyrie process is (a stuck worker tells
    where it waits); eyrie's warnings always reach stderr (Python's fallback printer goes quiet
    as soon as anything, such as the trainer's metrics hook on the root logger, adds a handler)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    own = logging.getLogger("eyrie")
    own.addHandler(logging.StreamHandler())
    own.propagate = False
