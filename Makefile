# Two commands do everything on a fresh machine:
#   make run    set up, then: python -m speedflags report --apply --restore
#   make test   set up, then: ruff, mypy, the test suite, and the benchmarks once (not timed)
# The pinned torch is installed first, so pip never resolves a bare `torch` (which would
# download the newest CUDA build, several GB). Override: make test TORCH_VERSION=2.4.1

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)

.PHONY: setup run test lint typecheck unit bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,dev]"
	touch $@

setup: $(STAMP)

run: setup
	$(PY) -m speedflags report --apply --restore

lint: setup
	$(PY) -m ruff check speedflags tests benchmarks
	$(PY) -m ruff format --check speedflags tests benchmarks

typecheck: setup
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest

bench: setup
	$(PY) -m pytest benchmarks --benchmark-only

test: lint typecheck unit
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks *.egg-info
