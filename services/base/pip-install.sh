#!/bin/sh
# `pip install ARGS` inside an image build. With wheels in /wheels (the host's wheelhouse, bind-mounted
# by the Dockerfile: `make wheelhouse`) it installs from them alone, with no network. Behind a
# TLS-intercepting proxy, a CA bundle given as the BuildKit secret `ca` (`--secret id=ca,src=FILE`)
# is trusted for this command only: a secret mount never lands in a layer. A package index of your
# own comes as the build argument PIP_INDEX_URL (its CA, if private, as that same secret).
set -eu
[ -n "${PIP_INDEX_URL:-}" ] || unset PIP_INDEX_URL
if [ -s /run/secrets/ca ]; then
    export PIP_CERT=/run/secrets/ca
fi
if ls /wheels/*.whl >/dev/null 2>&1; then
    set -- --no-index --find-links /wheels "$@"
fi
exec python3 -m pip install "$@"
