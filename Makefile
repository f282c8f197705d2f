# Two commands do everything on a fresh machine:
#   make run    set up, then: python -m speedflags report --apply --restore
#   make test   set up, then: ruff, mypy, the test suite, the benchmarks once (not timed) and
#               the examples with --smoke
# Measuring (benchmarks/RESULTS.md):
#   make bench     the pytest-benchmark suites, timed, with the speedup-and-accuracy table
#   make results   python -m speedflags bench, written to benchmarks/results/$(RESULTS).json
# On a machine with an NVIDIA GPU (no network, no virtual environment needed):
#   make gpu-check GPU_OUT=DIR   GPU tests, verify, bench, the benchmarks once and a summary,
#                                everything into DIR (docs/gpu_check.md)
# The pinned torch is installed first, so pip never resolves a bare `torch` (which would
# download the newest CUDA build, several GB).
#
# One PyTorch per virtual environment. CI runs `make test` for three of them (.ci/run):
#   make test                          torch 2.13.0, the CPU wheel, in .venv (the default)
#   make test TORCH_VERSION=2.4.1      legacy TF32 API only, in .venv-torch2.4.1 (make test-legacy)
#   make test-newest                   the newest release the registry serves, in its own venv
# VENV=... overrides the environment's directory.

PYTHON ?= python3
DEFAULT_TORCH := 2.13.0
LEGACY_TORCH := 2.4.1
TORCH_VERSION ?= $(DEFAULT_TORCH)
ifeq ($(strip $(TORCH_VERSION)),)
$(error TORCH_VERSION is empty: give an exact version such as 2.4.1)
endif
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH))
VENV ?= .venv
# The default leg installs every optional extra, so that their tests run there, not skip.
EXTRAS ?= test,dev,plot,yaml,lightning,transformers
# ...and the older package name too: the Lightning callback is tested against both.
EXTRA_PACKAGES ?= pytorch-lightning>=2.1
else
VENV ?= .venv-torch$(TORCH_VERSION)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
# pip's install report for the pinned torch: says whether it came from disk or the registry
TORCH_REPORT := $(VENV)/torch-install-report.json
EXTRAS ?= test,dev
DEVICE ?= cpu
RESULTS ?= $(DEVICE)

.PHONY: setup torch-source run test lint typecheck unit examples bench results gpu-check test-legacy test-newest test-all newest clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --report $(TORCH_REPORT).new "torch==$(TORCH_VERSION)"
	$(PY) .ci/torch_source.py --keep $(TORCH_REPORT).new $(TORCH_REPORT)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(if $(EXTRA_PACKAGES),$(PY) -m pip install --quiet "$(EXTRA_PACKAGES)")
	touch $@

setup: $(STAMP)

run: setup
	$(PY) -m speedflags report --apply --restore

lint: setup
	$(PY) -m ruff check speedflags tests benchmarks .ci examples
	$(PY) -m ruff format --check speedflags tests benchmarks .ci examples

typecheck: setup
	$(PY) -m mypy

# the suite under its own pytest plugin: a test that leaves a torch flag changed fails
unit: setup
	$(PY) -m pytest -p speedflags.pytest_plugin --speedflags-leaks=fail

bench: setup
	$(PY) -m pytest benchmarks --benchmark-only

results: setup
	$(PY) -m speedflags bench --device $(DEVICE) --passes 9 --json benchmarks/results/$(RESULTS).json

# Everything a GPU machine should prove, in one command, into $(GPU_OUT) (docs/gpu_check.md).
# No setup: it runs in the Python at hand (this checkout's .venv if there is one, else
# python3) from the source tree; the only install it may do is
# `pip install --no-deps --no-build-isolation -e .`. Without a GPU it runs the CPU parts,
# says so, and exits 0 when they pass.
GPU_OUT ?= gpu-check-out
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m speedflags.verify.gpu_check --out "$(GPU_OUT)"

# Which torch this environment runs, and from where (disk or registry): CI logs it per leg.
torch-source: setup
	@$(PY) .ci/torch_source.py --show $(TORCH_REPORT)

# Each example with --smoke (seconds on a CPU). An integration's example is skipped, saying
# so, where its extra is not installed (EXTRAS=test,dev,lightning,transformers installs both).
HAS_LIGHTNING := import importlib.util as u, sys; sys.exit(not ((u.find_spec("lightning") or u.find_spec("pytorch_lightning")) and u.find_spec("jsonargparse")))
HAS_TRANSFORMERS := import importlib.util as u, sys; sys.exit(not (u.find_spec("transformers") and u.find_spec("accelerate")))
examples: setup
	$(PY) examples/train_toy_transformer.py --smoke
	$(PY) examples/cifar10_resnet.py --smoke
	@if $(PY) -c '$(HAS_LIGHTNING)'; then $(PY) examples/lightning_yaml/train.py --smoke; \
	else echo "examples/lightning_yaml: skipped: pip install 'speedflags[lightning]'"; fi
	@if $(PY) -c '$(HAS_TRANSFORMERS)'; then $(PY) examples/hf_trainer.py --smoke; \
	else echo "examples/hf_trainer.py: skipped: pip install 'speedflags[transformers]'"; fi

test: torch-source lint typecheck unit examples
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider

test-legacy:
	$(MAKE) test TORCH_VERSION=$(LEGACY_TORCH)

# The newest torch release the registry serves, resolved first and then installed pinned;
# resolution fails loudly (no registry, or only a local wheel) instead of testing another.
newest:
	@$(PYTHON) .ci/newest_torch.py

# Its pip calls run with the machine's pip cap (a constraints file) lifted: see .ci/newest_torch.py.
test-newest:
	version="$$($(PYTHON) .ci/newest_torch.py)" && \
	$(PYTHON) .ci/newest_torch.py exec $(MAKE) test TORCH_VERSION="$$version"

test-all: test test-legacy test-newest

clean:
	rm -rf .venv .venv-torch* .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks *.egg-info gpu-check-out
