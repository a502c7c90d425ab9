#!/bin/sh
# bench/gpu_checks.py on the device tool's lent H200. Its image holds torch, transformers and triton but
# not eyrie's other packages, vLLM or redis-server, and reaches no registry: the wheels come in .whl/
# and a redis-server with its libraries in .gpu/ (both ignored, carried; made here as bench/RESULTS.md's
# "GPU checks" section says).  Run: device run, carry [.whl, .gpu], command `sh bench/gpu_lent_machine.sh`.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl 2>&1 | grep -v "^ERROR: pip's dependency resolver\|^  *\|^$" || true
export PATH="$PWD/.gpu/bin:$PATH" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:$PWD/services/extractor:$PWD/services/trainer:$PWD/services/generator:$PWD/services/inference"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, speculators, eyrie.work.gpu, eyrie_trainer; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 bench/gpu_checks.py --out "${OUT:-bench/gpu-results}" "$@"
