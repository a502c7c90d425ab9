#!/bin/sh
# eyrie inference container: print the exact `vllm serve` command that the EYRIE_* settings
# produce, then hand over to `eyrie serve --server vllm`, which runs that command, waits until
# /v1/models answers (deadline EYRIE_SERVE_DEADLINE_S), shows load progress and publishes the
# endpoint in Redis (EYRIE_ADVERTISE_URL) for the generator workers.
#
#   entrypoint.sh                   serve (the container's default)
#   entrypoint.sh --print-command   print the vllm command line and exit (no GPU needed)
#   entrypoint.sh ARGS...           extra `eyrie serve` flags, e.g. --model /models/target
# The line printed first comes from the EYRIE_* environment alone; `eyrie serve` prints the command
# it actually runs again ("eyrie serve: vllm serve ..."), flags included.
set -eu

show_command() {
    python3 - <<'PY'
import shlex
import sys

from eyrie.core.config import load_settings
from eyrie.core.errors import EyrieError
from eyrie_inference.server import command

try:
    settings = load_settings(server="vllm")
except EyrieError as exc:
    sys.exit(f"eyrie-inference: {exc}")
print(shlex.join(command(settings, settings.model)))
PY
}

if [ "${1:-}" = "--print-command" ]; then
    show_command
    exit 0
fi

cmd=$(show_command)
echo "eyrie-inference: vllm command: ${cmd}"
exec eyrie serve --server vllm "$@"
