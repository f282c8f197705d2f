"""``import speedflags`` loads the levers, the ledger and the blocks; the rest on first use.

Each check runs in a fresh interpreter (what a program sees at its first ``import``), with
torch imported first: at most 52 of speedflags' own modules, none
of the tools, and every name loaded on first use resolving to the same object, under the
same spelling, as it did when everything loaded at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import mypy_disagrees, needs_mypy

import speedflags
from speedflags._lazy import LAZY

ROOT = Path(speedflags.__file__).resolve().parent.parent
# 40 for the process and thread levers, 4 more for the model levers (param_dtype,
# memory_format and the shadow classes they share), 1 for the levers' declarations
# (levers/spec.py), 2 for the ledger's Frame and history ring in modules of their own
# (_ledger/frame.py, _ledger/ring.py), 1 for the fp8 lever's declaration (levers/fp8.py: its
# swap and torchao adapter load when a block asks for it), 1 for the locks a forked child
# finds free (_locks/), 3 for the model levers' state, cast cache and channels_last weights
# in modules of their own (levers/_model_state.py, _model_casts.py, _model_layout.py);
# docs/measured.md states the figure
MAX_MODULES_AT_IMPORT = 52
# Loaded on first use only: the tools, the status readers, the rank check, the watch, the
# training helpers, compile (only @speedup(compile=...) needs it).
NOT_AT_IMPORT = (
    "speedflags._lazy",  # the first-use table itself, loaded by the first such name
    "speedflags._measure",
    "speedflags.bench",
    "speedflags._compile",
    "speedflags._distributed",
    "speedflags.integrations",
    "speedflags.leak_report",
    "speedflags.pytest_plugin",
    "speedflags.report",
    "speedflags._schedule",
    "speedflags._status",
    "speedflags.training",
    "speedflags._tune",
    "speedflags._verify",
    "speedflags._watch",
)
# What a function torch.compile traces may name: bound at import (PyTorch 2.1's dynamo
# reads the module's __dict__, never its __getattr__).
BLOCKS = (
    "FastMath",
    "autocast",
    "cudnn_benchmark",
    "deterministic",
    "fast_math",
    "ledger",
    "matmul_precision",
    "reduced_precision_reduction",
    "sdpa_backend",
    "speedup",
    "tf32",
)


def run_python(code: str) -> Any:
    """Run ``code`` in a fresh interpreter on this checkout; return what it printed (JSON)."""
    # without SPEEDFLAGS_WATCH, which loads the watch at import (test_watch_lifecycle.py)
    environment = {k: v for k, v in os.environ.items() if k != "SPEEDFLAGS_WATCH"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


AT_IMPORT_THEN_FIRST_USE = """
import json, sys, types, torch
import speedflags
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "speedflags")
bound = sorted(vars(speedflags))
listed = sorted(set(speedflags.__all__) - set(dir(speedflags)))
from speedflags._lazy import LAZY
first_use = {}
for name, module in LAZY.items():
    full = "speedflags" + module
    value = getattr(speedflags, name)
    first_use[name] = {
        "after": full in sys.modules,
        "kind": "module" if isinstance(value, types.ModuleType) else type(value).__name__,
        "class_module": value.__module__ if isinstance(value, type) else None,
        "bound": name in vars(speedflags) or isinstance(value, types.ModuleType),
    }
print(json.dumps({"loaded": loaded, "bound": bound, "listed": listed, "first_use": first_use}))
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, Any]:
    found: dict[str, Any] = run_python(AT_IMPORT_THEN_FIRST_USE)
    return found


def test_import_loads_at_most_the_stated_modules_and_no_tool(fresh: dict[str, Any]) -> None:
    loaded = fresh["loaded"]
    assert len(loaded) <= MAX_MODULES_AT_IMPORT, loaded
    early = [m for m in loaded if m.startswith(NOT_AT_IMPORT)]
    assert early == [], f"loaded at import: {early}"
    assert "speedflags.levers.registry" in loaded and "speedflags._ledger.ledger" in loaded
    # every name not loaded on first use is bound at import, the blocks among them
    eager = set(speedflags.__all__) - set(LAZY)
    assert eager | set(BLOCKS) <= set(fresh["bound"])
    assert set(BLOCKS).isdisjoint(LAZY)
    assert fresh["listed"] == []  # dir() lists the names before they are loaded


def test_each_name_loads_its_module_on_first_use(fresh: dict[str, Any]) -> None:
    # (none of these modules was loaded at import: the test above)
    first_use: dict[str, dict[str, Any]] = fresh["first_use"]
    assert set(first_use) == set(LAZY)
    for name, seen in first_use.items():
        assert seen["after"], name
        assert seen["bound"], name  # looked up once, an ordinary attribute afterwards
        if seen["class_module"] is not None:  # a public class says where users find it
            assert seen["class_module"] == "speedflags", name
    assert {name: first_use[name]["kind"] for name in ("bench", "report", "tune", "verify")} == {
        "bench": "module",
        "report": "module",
        "tune": "function",
        "verify": "function",
    }


SUBPACKAGE_FIRST = """
import json, sys, torch
import speedflags
import speedflags._tune.cli, speedflags._verify.cli  # the subpackages, before the functions
tune_is_function = callable(speedflags.tune)
from speedflags import tune, TuneResult, load_levers, verify, Verification
from speedflags._tune import tune as tune_itself
from speedflags._tune.result import TuneResult as result_itself
from speedflags._measure.lever_files import load_levers as load_itself
from speedflags._measure.verdicts import verify as verify_itself
print(json.dumps({
    "functions": [tune_is_function, callable(speedflags.verify)],
    "same": [tune is tune_itself, TuneResult is result_itself, load_levers is load_itself,
             verify is verify_itself, speedflags.tune is tune, speedflags.verify is verify],
    "class_module": [TuneResult.__module__, Verification.__module__],
    "modules": [speedflags.bench.__name__, speedflags.report.__name__],
}))
"""


def test_from_import_and_the_subpackages_give_the_same_objects() -> None:
    # The import system binds a submodule on its package when it loads it: speedflags.tune
    # and speedflags.verify stay the functions when their subpackages are imported first.
    found = run_python(SUBPACKAGE_FIRST)
    assert found["functions"] == [True, True]
    assert found["same"] == [True] * 6
    assert found["class_module"] == ["speedflags", "speedflags"]
    assert found["modules"] == ["speedflags.bench", "speedflags.report"]


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'tun'"):
        speedflags.tun  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(speedflags, "tun")


MYPY_SNIPPET = """\
import speedflags
from speedflags import TuneResult, tune

result: TuneResult = tune(lambda: None)
speedflags.verify("cpu").ok
speedflags.bench.WORKLOADS["matmul"]
speedflags.tun  # error
speedflags.verify("cpu").okay  # error
"""


@needs_mypy
def test_type_checkers_see_the_names_loaded_on_first_use(tmp_path: Path) -> None:
    # The module's __getattr__ is hidden from type checkers: a misspelled name stays an
    # error, and the names loaded on first use keep their types.
    accepted, refused, output = mypy_disagrees(MYPY_SNIPPET, tmp_path, "uses_lazy_names.py")
    assert not accepted and not refused, output
