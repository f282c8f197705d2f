"""watch() itself: starting, nesting, stopping with nothing left behind, changes made around
Python, SPEEDFLAGS_WATCH and what ``import speedflags`` imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _watch_helpers import undo, unwatched  # noqa: F401 - fixtures

import speedflags
from speedflags import fast_math
from speedflags._watch.setters import SETTERS
from speedflags.levers import _fp32_torch as family
from speedflags.levers.precision import FamilyLever
from speedflags.levers.registry import lever_spec

HERE = os.path.abspath(__file__)


def benchmark_attribute() -> None:
    torch.backends.cudnn.benchmark = True


# --- starting, stopping, nothing left behind -----------------------------------------------


def installed() -> dict[str, Any]:
    """Every name watch() may replace, as it is now."""
    found: dict[str, Any] = {}
    for name in SETTERS:
        found[f"torch._C.{name}"] = getattr(torch._C, name, None)
        found[f"torch.{name}"] = getattr(torch, name, None)
    for module_name in ("torch.backends", "torch.backends.cudnn", "torch.backends.mkldnn"):
        module = sys.modules[module_name]
        for attr, value in vars(type(module)).items():
            if hasattr(value, "setter") and not isinstance(value, property):
                found[f"{module_name}.{attr}"] = value.setter
    return found


@pytest.mark.usefixtures("unwatched")
def test_stop_puts_every_original_back() -> None:
    before = installed()
    w = speedflags.watch()
    assert w.start() is w
    during = installed()
    assert [k for k in before if during[k] is not before[k]], "nothing was wrapped"
    assert (
        type(torch.backends.cudnn).__dict__["benchmark"].setter
        is not before["torch.backends.cudnn.benchmark"]
    )
    w.stop()
    after = installed()
    assert all(after[k] is before[k] for k in before)


def test_speedflags_caches_no_wrapper_that_would_outlive_the_watch() -> None:
    family._PLANS.clear()
    family._TRUSTED.clear()
    family._FAST.clear()
    with speedflags.watch():
        for value in (True, False):
            with fast_math(tf32=value, matmul_precision="medium" if value else "highest"):
                pass
    cached = [fn for ops in family._TRUSTED.values() for fn, _ in ops]
    cached += [fn for _, ops in family._FAST.values() for fn, _ in ops]
    for name in ("tf32", "matmul_precision"):  # the last write each lever replays
        lever = lever_spec(name).lever("cpu")
        assert isinstance(lever, FamilyLever)
        cached += [fn for last in (lever._applied, lever._restored) for fn, _ in last[3]]
    assert cached
    assert not [fn for fn in cached if hasattr(fn, "__wrapped__")]


@pytest.mark.usefixtures("unwatched")
def test_watches_nest_and_only_the_last_stop_removes_the_wrappers() -> None:
    original = torch._C._set_cudnn_benchmark
    outer = speedflags.watch().start()
    with speedflags.watch() as inner:
        benchmark_attribute()
    assert torch._C._set_cudnn_benchmark is not original  # the outer watch still runs
    assert len(inner.records) == 1
    torch.backends.cudnn.benchmark = False
    outer.stop()
    outer.stop()  # stopping twice, or a watch never started, does nothing
    speedflags.watch().stop()
    assert torch._C._set_cudnn_benchmark is original
    assert [r.after for r in outer.records] == [True, False]
    assert repr(outer) == "<speedflags.watch() stopped>"


def test_as_a_decorator_each_call_is_watched() -> None:
    @speedflags.watch()
    def configure() -> None:
        torch.backends.cudnn.benchmark = True

    speedflags.ledger().clear_history()
    configure()
    (record,) = speedflags.ledger().history
    assert (record.action, record.label) == ("external", "configure")
    assert configure.__name__ == "configure"


def test_starting_a_started_watch_is_refused() -> None:
    with speedflags.watch() as w, pytest.raises(RuntimeError, match="already started"):
        w.start()


@pytest.mark.usefixtures("unwatched")
def test_nothing_is_recorded_when_not_watching() -> None:
    w = speedflags.watch()
    speedflags.ledger().clear_history()
    benchmark_attribute()
    assert w.records == ()
    assert speedflags.ledger().history == ()


# --- changes made around Python --------------------------------------------------------------


@pytest.mark.usefixtures("unwatched")
def test_a_change_around_python_is_found_at_the_next_boundary() -> None:
    # A reference to the C function taken before watching stands for C++ code: no wrapper
    # sees the call.
    unseen = torch._C._set_cudnn_benchmark
    with speedflags.watch() as w:
        with fast_math(tf32=False, label="first"):
            pass
        unseen(True)
        with fast_math(tf32=False, label="second"):
            pass
        unseen(False)
    (record,) = w.records  # the last change is after the last boundary: not seen
    assert (record.lever, record.action, record.before, record.after) == (
        "cudnn_benchmark",
        "external",
        False,
        True,
    )
    assert record.label == "unknown code"
    assert record.where == ""
    assert "between 'first' at" in record.reason and "and 'second' at" in record.reason
    assert HERE in record.reason


def run_python(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "SPEEDFLAGS_WATCH"}
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(Path(speedflags.__file__).parent.parent), environment.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


WATCHED_AT_IMPORT = """
import sys, torch, speedflags
torch.backends.cudnn.benchmark = True
print([(r.lever, r.action, r.label) for r in speedflags.ledger().history])
print(sorted(m for m in ("pytest", "transformers") if m in sys.modules))
"""


def test_speedflags_watch_env_starts_watching_at_import() -> None:
    out = run_python(WATCHED_AT_IMPORT, SPEEDFLAGS_WATCH="1").splitlines()
    assert out == ["[('cudnn_benchmark', 'external', '<module>')]", "[]"]


def test_without_the_env_nothing_is_watched_and_no_extra_is_imported() -> None:
    out = run_python(WATCHED_AT_IMPORT).splitlines()
    assert out == ["[]", "[]"]
