# Two commands do everything on a fresh machine:
#   make run    set up, then: python -m speedflags report --apply --restore
#   make test   set up, then: ruff, mypy, the test suite, and the benchmarks once (not timed)
# Measuring (benchmarks/RESULTS.md):
#   make bench     the pytest-benchmark suites, timed, with the speedup-and-accuracy table
#   make results   python -m speedflags bench, written to benchmarks/results/$(RESULTS).json
# The pinned torch is installed first, so pip never resolves a bare `torch` (which would
# download the newest CUDA build, several GB). Override: make test TORCH_VERSION=2.4.1

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
DEVICE ?= cpu
RESULTS ?= $(DEVICE)

.PHONY: setup run test lint typecheck unit bench results clean

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

results: setup
	$(PY) -m speedflags bench --device $(DEVICE) --passes 9 --json benchmarks/results/$(RESULTS).json

test: lint typecheck unit
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks *.egg-info
