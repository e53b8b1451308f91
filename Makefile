# Parley: `make run` brings the suite up on this machine; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test-tools promtool chromium run test lint typecheck unit e2e bench gen secrets fmt infra-up infra-down infra-status clean

install: $(STAMP)

# What the tests need beyond the virtualenv. tests/unit/test_deploy*.py check deploy/prometheus.yml,
# the alert rules and the dashboard's queries with promtool, from Debian's prometheus package:
# installed only where it is missing (apt-get as root, else through sudo); if that fails, the build
# stops here, not in a skipped check. `make run` does not need it.
test-tools: promtool chromium

promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "promtool is missing: installing Debian's prometheus package for the deployment checks"; \
	  as_root=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  { $$as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$as_root apt-get install -y -qq \
	      --no-install-recommends prometheus >/dev/null; } \
	  || { echo "error: could not install promtool (apt-get install prometheus failed);" \
	       "install Debian's prometheus package or put promtool on PATH" >&2; exit 1; }; \
	  command -v promtool >/dev/null 2>&1 \
	  || { echo "error: the prometheus package is installed but promtool is not on PATH" >&2; exit 1; }; }

# tests/e2e/test_web_page.py drives the chat page in a real headless browser: Debian's chromium
# (playwright's own browser download does not work on these machines; it is pointed at
# /usr/bin/chromium). Installed only where it is missing, like promtool.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "chromium is missing: installing Debian's chromium for the web page's browser test"; \
	  as_root=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  { $$as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$as_root apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver >/dev/null; } \
	  || { echo "error: could not install chromium (apt-get install chromium chromium-driver failed)" >&2; \
	       exit 1; }; }

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Parley needs Python 3.11, found {sys.version.split()[0]} (set PYTHON=...)"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# llama-cpp-python has no wheel here: built once from source (about 4 minutes on 2 cores) without
	@# native CPU detection, which crashes on CPUs reporting AMX (ENV.md), and never from a cached wheel.
	$(BIN)/python -c 'import llama_cpp, sys; sys.exit(llama_cpp.__version__ != "0.3.36")' 2>/dev/null || \
	  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
	  $(BIN)/pip install --quiet --disable-pip-version-check --no-cache-dir llama-cpp-python==0.3.36
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	rm -f $(VENV)/.installed-* && touch $@

run: install  ## the whole suite, embedded NATS/Postgres unless PARLEY_NATS_URL/PARLEY_DATABASE_URL are set
	$(BIN)/parley run

test: install test-tools lint typecheck  ## every test, infrastructure included
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: install
	$(BIN)/mypy

unit: install test-tools
	$(BIN)/pytest tests/unit

e2e: install chromium
	$(BIN)/pytest tests/e2e

bench: install  ## benchmarks (not timed tests); each prints a JSON line last
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

gen: install  ## regenerate the protobuf code under libs/proto, docs/errors.md and deploy/nats-auth.conf
	$(BIN)/python tools/gen_proto.py
	$(BIN)/python tools/gen_errors.py
	$(BIN)/python tools/gen_nats_conf.py

secrets: install  ## write .env (docker-compose's secrets) unless there is one
	@if [ -e .env ]; then echo ".env exists; remove it to generate new secrets"; else \
	  umask 077 && $(BIN)/python tools/gen_secrets.py > .env && echo "wrote .env"; fi

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

infra-up: install
	$(BIN)/parley infra up

infra-down: install
	$(BIN)/parley infra down

infra-status: install
	$(BIN)/parley infra status

clean: infra-down
	rm -rf .parley .mypy_cache .ruff_cache .pytest_cache .hypothesis
