# eyrie: `make demo` (the pipeline on the embedded default) and `make test` set up everything.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_UPDATE_CHECK := 1
REQS := requirements/base.txt requirements/generator.txt requirements/inference.txt \
        requirements/speculators.txt requirements/api.txt requirements/dev.txt pyproject.toml

.PHONY: setup test faults demo redis chromium api bench gpu-checks compose-check up down ps logs status run clean tiny-target

setup: $(VENV)/.installed redis chromium

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

test: setup
	$(BIN)/pytest -q

# The fault suite alone (it is also part of `make test`): writes docs/faults.md
faults: setup
	$(BIN)/pytest -q tests/test_faults.py

# The embedded default: Redis on 127.0.0.1:6379 (started here if none answers), a local
# file store in .eyrie/store, transformers serve on the tiny target, one generator worker.
demo: setup
	@$(BIN)/python -c "import redis; redis.Redis.from_url('$${EYRIE_REDIS_URL:-redis://127.0.0.1:6379/0}').ping()" 2>/dev/null \
	  || { mkdir -p .eyrie/redis && redis-server --daemonize yes --port 6379 --bind 127.0.0.1 \
	       --dir $$PWD/.eyrie/redis --appendonly yes --logfile $$PWD/.eyrie/redis/redis.log && sleep 1; }
	$(BIN)/eyrie demo

# The control API and dashboard on http://127.0.0.1:8080/ (EYRIE_API_TOKEN for mutating calls)
api: setup
	$(BIN)/eyrie api

bench: setup
	$(BIN)/python bench/generate_throughput.py

# Every GPU check in one command (< 8 min on one H200); --dry-run says what it would measure
gpu-checks: setup
	$(BIN)/python bench/gpu_checks.py

tiny-target: setup
	$(BIN)/python scripts/build_tiny_target.py --out assets/tiny-target

compose-check: setup
	$(BIN)/pytest -q tests/test_compose.py

# The Compose stack on a GPU host (needs a Docker engine; not available on our CI machines).
up:
	docker compose -f docker-compose.yml -f compose.gpu.yml up -d --build
down:
	docker compose -f docker-compose.yml -f compose.gpu.yml down
ps:
	docker compose -f docker-compose.yml -f compose.gpu.yml ps
logs:
	docker compose -f docker-compose.yml -f compose.gpu.yml logs -f --tail=100
status:
	$(BIN)/eyrie status $(RUN)

# One pipeline from a config file, on the stack: `make run CONFIG=examples/run.kimi-k2.5.yaml`
# (the generator image runs `eyrie run`; the stages then follow by themselves). PLAN=1: projection only.
CONFIG ?= examples/run.tiny.yaml
run:
	docker compose -f docker-compose.yml -f compose.gpu.yml run --rm --no-deps \
	  -v $(abspath $(CONFIG)):/home/eyrie/run.yaml:ro generator run --config /home/eyrie/run.yaml $(if $(PLAN),--plan)

clean:
	rm -rf .eyrie
