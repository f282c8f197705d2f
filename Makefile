# Two commands do everything on a fresh machine:
#   make run    torch (pinned) and speedflags only, then: python -m speedflags report --apply --restore
#   make test   the same, then the extras and dev tools (EXTRAS), then: ruff, mypy, the test
#               suite, the examples with --smoke and the benchmarks once (not timed); when a
#               step fails, the steps it did not reach are named
#   make docs   the documentation site into site/ (mkdocs build --strict), its tools (the docs
#               extra) installed on top of the pinned torch, the figures of the measured
#               results redrawn when a result file changes
# Measuring (benchmarks/RESULTS.md):
#   make bench     the pytest-benchmark suites, timed, with the speedup-and-accuracy table
#   make results   python -m speedflags bench, written to benchmarks/results/$(RESULTS).json
# On a machine with an NVIDIA GPU (no network, no virtual environment needed):
#   make gpu-check GPU_OUT=DIR   the suite, GPU tests, verify, FP8 headroom, the train step,
#                                the overhead, bench, the benchmarks once and a summary,
#                                everything into DIR (docs/gpu_check.md; GPU_ARGS=... for more)
# The pinned torch is installed first, so pip never resolves a bare `torch` (which would
# download the newest CUDA build, several GB).
#
# One Python and one PyTorch per virtual environment. CI (.ci/run) runs `make test` for four:
#   make test-default   Python 3.11, torch 2.13.0 (the CPU wheel) and every optional extra, in .venv
#                       (plain `make test` is this leg when python3 is 3.11)
#   make test-floor     Python 3.10, torch 2.1.2: the oldest the package claims (legacy TF32 API only)
#   make test-py312     Python 3.12, torch 2.13.0, without the optional extras (the GPU image's
#                       Python; the extras' tests skip, saying so)
#   make test-newest    Python 3.13, the newest torch release the registry serves for it
# PYTHON=... (a command or a path) and TORCH_VERSION=... choose any other pair, in a
# virtual environment of its own (.venv-pyX.Y-torchV; VENV=... to choose);
# `.ci/find_python.sh X.Y` prints an installed Python X.Y (pyenv's included).

PYTHON ?= python3
# X.Y of $(PYTHON), or empty when it does not run
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PYTHON_VERSION),)
$(error PYTHON=$(PYTHON): no such Python interpreter (not on the PATH, or it does not run); give a command or a path, e.g. PYTHON=$$(.ci/find_python.sh 3.10))
endif
DEFAULT_PYTHON_VERSION := 3.11
DEFAULT_TORCH := 2.13.0
FLOOR_PYTHON_VERSION := 3.10
FLOOR_TORCH := 2.1.2
# torch 2.1 was built against NumPy 1.x; its torch.onnx imports transformers when installed,
# and transformers from 4.56 on needs a newer torch (torch.utils._pytree.register_pytree_node);
# its cpp_extension (inductor) imports pkg_resources, which setuptools 81 removed
FLOOR_PINS := numpy<2 transformers<4.56 setuptools<81
PY312_PYTHON_VERSION := 3.12
NEWEST_PYTHON_VERSION := 3.13
TORCH_VERSION ?= $(DEFAULT_TORCH)
ifeq ($(strip $(TORCH_VERSION)),)
$(error TORCH_VERSION is empty: give an exact version such as 2.1.2)
endif
# requirements installed with the package (quoted one by one), e.g. PINS='numpy<2'
PINS ?=
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH))
# The default leg installs every optional extra, so that their tests run there, not skip
# (fp8's torchao needs torch>=2.11: the floor leg's EXTRAS leave it out, and its tests skip).
EXTRAS ?= test,dev,plot,yaml,lightning,transformers,fp8,docs
# ...and the older package name too: the Lightning callback is tested against both.
EXTRA_PACKAGES ?= pytorch-lightning>=2.1
ifeq ($(PYTHON_VERSION),$(DEFAULT_PYTHON_VERSION))
VENV ?= .venv
endif
endif
VENV ?= .venv-py$(PYTHON_VERSION)-torch$(TORCH_VERSION)
PY := $(VENV)/bin/python
# Two stamps: torch and speedflags (what `make run` needs), then the extras and dev tools on
# top (what `make test` needs), so `make test` after `make run` installs only the rest.
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
comma := ,
# pip's install report for the pinned torch: says whether it came from disk or the registry
TORCH_REPORT := $(VENV)/torch-install-report.json
EXTRAS ?= test,dev
DEVICE ?= cpu
RESULTS ?= $(DEVICE)
# the extras and dev tools of `make test`, per set of EXTRAS (a new set installs its own)
EXTRAS_STAMP := $(VENV)/.installed-extras-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup setup-run torch-source run test lint typecheck unit examples benchmarks-once bench results gpu-check test-default test-floor test-py312 test-newest test-all newest clean setup-default setup-floor setup-py312 setup-newest docs docs-default

# torch first, pinned (pip never resolves a bare `torch`), then speedflags on it: nothing else
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --report $(TORCH_REPORT).new "torch==$(TORCH_VERSION)" || { \
	  echo "make: torch==$(TORCH_VERSION) cannot be installed for Python $(PYTHON_VERSION) ($(PYTHON)): pip's reason is above" >&2; \
	  exit 1; }
	$(PY) .ci/torch_source.py --keep $(TORCH_REPORT).new $(TORCH_REPORT)
	$(PY) -m pip install --quiet -e .
	touch $@

# the optional extras and the dev tools, on top of the pinned torch (never another torch)
$(EXTRAS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)" $(foreach pin,$(PINS),'$(pin)')
	$(if $(EXTRA_PACKAGES),$(PY) -m pip install --quiet "$(EXTRA_PACKAGES)" "torch==$(TORCH_VERSION)")
	touch $@

setup-run: $(STAMP)

setup: $(EXTRAS_STAMP)

run: setup-run
	$(PY) -m speedflags report --apply --restore

lint: setup
	$(PY) -m ruff check speedflags tests benchmarks tools .ci examples docs/_hooks
	$(PY) -m ruff format --check speedflags tests benchmarks tools .ci examples docs/_hooks

typecheck: setup
	$(PY) -m mypy

# the suite under its own pytest plugin: a test that leaves a torch flag changed fails. In
# UNIT_WORKERS pytest-xdist processes (the CI machines have two cores; most tests are
# single-threaded Python), each taking a whole file at a time; UNIT_WORKERS=0: one process
UNIT_WORKERS ?= 2
unit: setup
	$(PY) -m pytest -p speedflags.pytest_plugin --speedflags-leaks=fail -n $(UNIT_WORKERS) --dist loadfile

bench: setup
	$(PY) -m pytest benchmarks --benchmark-only

results: setup
	$(PY) -m speedflags bench --device $(DEVICE) --passes 9 --json benchmarks/results/$(RESULTS).json

# The documentation site (mkdocs.yml): the pages of docs/, the README as its landing page, an
# API reference from the docstrings, and one figure per device of the measured results,
# drawn from benchmarks/results/*.json by benchmarks/plot_results.py into $(FIGURES) when a
# result file (or the script) is newer than the figures. --strict: a broken link, a page
# missing from the navigation or a docstring mkdocstrings cannot read fails the build.
# Its tools are the docs extra (and matplotlib, the plot extra), on top of the pinned torch.
DOCS_STAMP := $(VENV)/.installed-docs
FIGURES := build/docs-figures
RESULT_FILES := $(wildcard benchmarks/results/*.json)

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs,plot]" "torch==$(TORCH_VERSION)" $(foreach pin,$(PINS),'$(pin)')
	touch $@

$(FIGURES)/.drawn: $(RESULT_FILES) benchmarks/plot_results.py | $(DOCS_STAMP)
	$(PY) benchmarks/plot_results.py --out $(FIGURES)
	touch $@

# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, which mkdocs<2 (the extra) is not
docs: $(DOCS_STAMP) $(FIGURES)/.drawn
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Everything a GPU machine should prove, in one command, into $(GPU_OUT) (docs/gpu_check.md).
# No setup: it runs in the Python at hand (this checkout's .venv if there is one, else
# python3) from the source tree; the only install it may do is
# `pip install --no-deps --no-build-isolation -e .`. Without a GPU it runs the CPU parts,
# says so, and exits 0 when they pass.
GPU_OUT ?= gpu-check-out
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
# GPU_ARGS: more options, e.g. GPU_ARGS='--preset first --export /path/to/eight-files'
GPU_ARGS ?=
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m tools.gpu_check --out "$(GPU_OUT)" $(GPU_ARGS)

# Which Python and torch this environment runs, and where torch came from (disk or registry):
# CI logs it per leg, e.g. "=== leg: Python 3.10.13, torch 2.1.2 (registry) ===".
torch-source: setup-run
	@$(PY) .ci/torch_source.py --show $(TORCH_REPORT)

# Each example with --smoke (15 to 26 s each on a busy 2-core CPU). An integration's example is skipped, saying
# so, where its extra is not installed (EXTRAS=test,dev,lightning,transformers installs both).
HAS_LIGHTNING := import importlib.util as u, sys; sys.exit(not ((u.find_spec("lightning") or u.find_spec("pytorch_lightning")) and u.find_spec("jsonargparse")))
HAS_TRANSFORMERS := import importlib.util as u, sys; sys.exit(not (u.find_spec("transformers") and u.find_spec("accelerate")))
examples: setup
	$(PY) examples/train_toy_transformer.py --smoke
	$(PY) examples/cifar10_resnet.py --smoke
	@if $(PY) -c '$(HAS_LIGHTNING)'; then $(PY) examples/lightning_yaml/train.py --smoke && \
	$(PY) examples/lightning_model_levers.py --smoke; \
	else echo "examples/lightning_*: skipped: pip install '.[lightning]'"; fi
	@if $(PY) -c '$(HAS_TRANSFORMERS)'; then $(PY) examples/hf_trainer.py --smoke && \
	$(PY) examples/hf_model_levers.py --smoke; \
	else echo "examples/hf_*: skipped: pip install '.[transformers]'"; fi

# the benchmarks once, untimed: that each still runs, not what it measures
benchmarks-once: setup
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider

# One step after another (each a target of its own: `make unit`, `make examples`, ...); when
# one fails, the ones it did not reach are named, and make exits with the failure.
TEST_STEPS := torch-source lint typecheck unit examples benchmarks-once
test: setup
	@left="$(TEST_STEPS)"; for step in $(TEST_STEPS); do \
	  left="$${left#$$step}"; left="$${left# }"; \
	  if ! $(MAKE) --no-print-directory $$step; then \
	    echo "make test: the step '$$step' failed; not run: $${left:-none (it was the last)}" >&2; \
	    exit 1; \
	  fi; \
	done; echo "make test: every step passed: $(TEST_STEPS)"

# Each CI leg: its Python and its environment's arguments. `make test-LEG` runs the README's
# test command (`make test`) there; `make setup-LEG` only makes the environment (.ci/run makes
# the later legs' in the background while the first leg runs: their torch is a download).
default_PYTHON := $(DEFAULT_PYTHON_VERSION)
default_ARGS := TORCH_VERSION=$(DEFAULT_TORCH)
floor_PYTHON := $(FLOOR_PYTHON_VERSION)
floor_ARGS := TORCH_VERSION=$(FLOOR_TORCH) PINS='$(FLOOR_PINS)'
# The Python of the GPU image, with the default's torch (from the registry: the CPU wheel on
# disk is for Python 3.11) and no optional extra, so that their tests skip as they say.
py312_PYTHON := $(PY312_PYTHON_VERSION)
py312_ARGS := TORCH_VERSION=$(DEFAULT_TORCH) EXTRAS=test,dev EXTRA_PACKAGES=

test-default test-floor test-py312: test-%:
	py="$$(.ci/find_python.sh $($*_PYTHON))" && $(MAKE) test PYTHON="$$py" $($*_ARGS)

setup-default setup-floor setup-py312: setup-%:
	py="$$(.ci/find_python.sh $($*_PYTHON))" && $(MAKE) setup PYTHON="$$py" $($*_ARGS)

# the site, in the default leg's environment (CI builds it after that leg's tests)
docs-default:
	py="$$(.ci/find_python.sh $(default_PYTHON))" && $(MAKE) docs PYTHON="$$py" $(default_ARGS)

# The newest torch release the registry serves for Python $(NEWEST_PYTHON_VERSION), resolved
# first and then installed pinned; resolution fails loudly (no registry, or only a local
# wheel) instead of testing another.
newest:
	@py="$$(.ci/find_python.sh $(NEWEST_PYTHON_VERSION))" && "$$py" .ci/newest_torch.py

# Its pip calls run with the machine's pip cap (a constraints file) lifted: see .ci/newest_torch.py.
test-newest setup-newest: %-newest:
	py="$$(.ci/find_python.sh $(NEWEST_PYTHON_VERSION))" && \
	version="$$("$$py" .ci/newest_torch.py)" && \
	"$$py" .ci/newest_torch.py exec $(MAKE) $* PYTHON="$$py" TORCH_VERSION="$$version"

test-all: test-default test-floor test-py312 test-newest

clean:
	rm -rf .venv .venv-py* .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks *.egg-info gpu-check-out site $(FIGURES)
