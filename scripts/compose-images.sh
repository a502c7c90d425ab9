#!/usr/bin/env bash
# The stack's images, in order: eyrie-base (the layer every service shares), then each service.
#   EYRIE_BASE_IMAGE=IMAGE   eyrie-base's base (default: the official python:3.11-slim-bookworm, or a
#                            local debootstrap import when it cannot be pulled: scripts/base-image.sh)
#   EYRIE_CA_BUNDLE=FILE     CA bundle of a TLS-intercepting proxy, a BuildKit secret (in no layer)
#   EYRIE_PIP_INDEX_URL=URL  a package index of your own for pip (a mirror, a private index), its CA
#                            as EYRIE_CA_BUNDLE; a build argument (no credentials in it)
#   EYRIE_CPU_STACK=1        the CPU stack (compose.ci.yml): inference on vLLM's CPU build
#                            (eyrie-vllm-cpu) instead of the vLLM GPU image, plus its Redis and S3
#                            stand-ins
# wheelhouse/*.whl, when present, is all pip installs from (scripts/wheelhouse.sh): no network.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${EYRIE_BASE_IMAGE:-$(scripts/base-image.sh)}
opts=(--build-arg "BASE_IMAGE=$base")
[ -n "${EYRIE_CA_BUNDLE:-}" ] && opts+=(--secret "id=ca,src=$EYRIE_CA_BUNDLE")
[ -n "${EYRIE_PIP_INDEX_URL:-}" ] && opts+=(--build-arg "PIP_INDEX_URL=$EYRIE_PIP_INDEX_URL")
# With a wheelhouse the builds need no network at all: they get none (as on an air-gapped host).
offline=(); ls wheelhouse/*.whl >/dev/null 2>&1 && offline=(--network none)
build() { local tag=$1; shift; echo "images: $tag" >&2; docker build -q "$@" -t "$tag" . >/dev/null; }

build eyrie-base "${opts[@]}" "${offline[@]}" -f services/base/Dockerfile
opts=("${opts[@]:2}")  # the services build FROM eyrie-base
for svc in generator api extractor trainer; do
  build "eyrie-$svc:local" "${opts[@]}" "${offline[@]}" -f "services/$svc/Dockerfile"
done
if [ "${EYRIE_CPU_STACK:-0}" = 1 ]; then
  # the vLLM image's CPU stand-in, then the inference image on it exactly as on the GPU image
  build eyrie-vllm-cpu:local "${opts[@]}" "${offline[@]}" --build-arg "BASE_IMAGE=$base" \
        -f services/inference/vllm-cpu.Dockerfile
  build eyrie-inference:local "${opts[@]}" "${offline[@]}" --build-arg BASE_IMAGE=eyrie-vllm-cpu:local \
        -f services/inference/Dockerfile
  build eyrie-ci-redis:local "${opts[@]}" --build-arg "BASE_IMAGE=$base" -f services/ci/redis.Dockerfile
  build eyrie-ci-s3:local "${opts[@]}" "${offline[@]}" -f services/ci/s3.Dockerfile
else
  build eyrie-inference:local "${opts[@]}" "${offline[@]}" -f services/inference/Dockerfile
fi
