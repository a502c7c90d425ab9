"""The `eyrie` command line: the control plane of the embedded default and of the stack.

Exit codes: 0 success; 1 a problem the message names (with its fix), e.g. an unknown run;
2 bad usage; 3 `--wait` or `watch` ended with the run failed (or blocked), or `audit` found a
sample lost or duplicated; 4 `--wait` or `watch` ended with the run cancelled.
"""

from __future__ import annotations

# Each group's commands register on cli_app's app as its module is imported: `eyrie --help` lists
# them in this order (the target served, a stage alone, the drafter, the pipeline, then control).
from eyrie.commands import cli_serve, cli_stages, cli_drafter, cli_pipeline, cli_control  # noqa: F401,I001
from eyrie.commands.cli_app import app, set_up_process

__all__ = ["app", "main"]


def main() -> None:
    set_up_process()
    app()


if __name__ == "__main__":
    main()
