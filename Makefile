# Parley: `make run` brings the suite up on this machine; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install run test lint typecheck unit e2e bench gen fmt infra-up infra-down infra-status clean

install: $(STAMP)

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

test: install lint typecheck  ## every test, infrastructure included
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/pytest tests/unit

e2e: install
	$(BIN)/pytest tests/e2e

bench: install  ## benchmarks (not timed tests); each prints a JSON line last
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

gen: install  ## regenerate the protobuf code under libs/proto and docs/errors.md
	$(BIN)/python tools/gen_proto.py
	$(BIN)/python tools/gen_errors.py

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
