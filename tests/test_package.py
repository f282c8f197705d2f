"""The public face: every public name is documented; what changes flags says its scope."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import sys
from typing import Any

import pytest

import speedflags
from speedflags import errors

PUBLIC = [name for name in speedflags.__all__ if name not in ("__version__", "UNSET")]

# The levers, context managers and decorators: each must say its scope (process or thread)
# and what it restores. Other names need no scope line: it would say nothing.
CHANGES_FLAGS = {
    "FlagLedger",
    "fast_math",
    "FastMath",
    "tf32",
    "matmul_precision",
    "cudnn_benchmark",
    "sdpa_backend",
    "deterministic",
    "reduced_precision_reduction",
    "autocast",
    "heal_tf32",
    "speedup",
    "Schedule",
    "TF32Schedule",
    "tune",
    "verify",
}


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(speedflags, name))
    assert doc, f"speedflags.{name} has no docstring"
    assert len(doc.split()) >= 8, f"speedflags.{name}'s docstring is too thin: {doc!r}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(speedflags, name)) or ""
    assert ">>>" in doc, f"speedflags.{name} has no example"


@pytest.mark.parametrize("name", sorted(CHANGES_FLAGS))
def test_levers_say_their_scope_and_what_they_restore(name: str) -> None:
    doc = (inspect.getdoc(getattr(speedflags, name)) or "").lower()
    assert "scope" in doc, f"speedflags.{name} does not say its scope"
    assert "process" in doc or "thread" in doc, f"speedflags.{name}: scope is not process/thread"
    assert "restore" in doc, f"speedflags.{name} does not say what it restores"


def test_all_is_exactly_the_public_face() -> None:
    # "@py_builtins"/"@pytest_ar": pytest rewrites the asserts of an installed plugin's whole
    # distribution (the speedflags package, through its pytest11 entry point)
    exported = {n for n in dir(speedflags) if not n.startswith(("_", "@"))}
    # the public modules show up as attributes once loaded; the private ones start with _
    modules = {
        "bench",
        "errors",
        "integrations",
        "leak_report",  # imported by pytest_plugin
        "levers",
        "pytest_plugin",  # imported when pytest loads it
        "report",
        "training",
    }
    assert set(speedflags.__all__) - {"__version__"} == exported - modules


def test_public_classes_report_the_package() -> None:
    for name in PUBLIC:
        obj = getattr(speedflags, name)
        if inspect.isclass(obj):
            assert obj.__module__ == "speedflags", name


def test_every_public_name_resolves_through_its_module_and_qualname() -> None:
    # What pickle, documentation tools and "where is this defined?" do: the private layout
    # may move (issue 20), the path an object gives for itself must still lead back to it.
    for name in PUBLIC:
        obj = getattr(speedflags, name)
        if not hasattr(obj, "__qualname__"):
            continue
        found: object = importlib.import_module(obj.__module__)
        for part in obj.__qualname__.split("."):
            found = getattr(found, part)
        assert found is obj, name


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_every_public_error_and_warning_pickles(name: str) -> None:
    cls = getattr(speedflags, name)
    copy = pickle.loads(pickle.dumps(cls("a message")))  # noqa: S301 - our own bytes
    assert type(copy) is cls and str(copy) == "a message"


def test_error_hierarchy() -> None:
    assert issubclass(errors.MixedTF32APIError, (speedflags.SpeedflagsError, RuntimeError))
    assert issubclass(errors.InvalidValueError, (speedflags.SpeedflagsError, ValueError))
    assert issubclass(errors.InvalidTypeError, (speedflags.SpeedflagsError, TypeError))
    assert issubclass(errors.LedgerOrderError, speedflags.SpeedflagsError)
    assert issubclass(errors.LeverUnavailableError, speedflags.SpeedflagsError)
    assert issubclass(errors.RankMismatchError, (speedflags.SpeedflagsError, RuntimeError))
    assert issubclass(errors.DriftWarning, speedflags.SpeedflagsWarning)
    assert issubclass(errors.SlowPathWarning, UserWarning)
    assert issubclass(errors.CompileFallbackWarning, speedflags.SpeedflagsWarning)


def test_unreadable_says_what_raised() -> None:
    a = speedflags.Unreadable("RuntimeError", "mix of the legacy and new APIs")
    assert a == speedflags.Unreadable("RuntimeError", "mix of the legacy and new APIs")
    assert a != speedflags.Unreadable("RuntimeError", "other")
    assert hash(a) == hash(speedflags.Unreadable("RuntimeError", "mix of the legacy and new APIs"))
    assert repr(a) == "<raises RuntimeError: mix of the legacy and new APIs>"
    assert a.to_json() == {"raises": "RuntimeError", "message": "mix of the legacy and new APIs"}


def _all_modules() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(speedflags.__path__, "speedflags."))


def test_every_module_imports_by_its_dotted_path() -> None:
    # Failed before the implementation moved under private names: `import
    # speedflags.tune.files as f` raised ImportError (speedflags.tune is the function), and
    # `import speedflags.fast_math as m` gave the function.
    checked = 0
    missing = []
    for name in _all_modules():
        namespace: dict[str, Any] = {}
        try:
            exec(f"import {name} as m", namespace)  # noqa: S102 - the statement under test
        except ModuleNotFoundError as exc:  # an optional extra (lightning) not installed here
            missing.append((name, exc.name))
            continue
        assert namespace["m"] is sys.modules[name], name
        checked += 1
    assert checked >= 100  # the walk found the package's modules
    assert [
        (name, dep) for name, dep in missing if dep is None or dep.startswith("speedflags")
    ] == []


def test_no_public_name_shadows_a_module() -> None:
    top_level = {info.name for info in pkgutil.iter_modules(speedflags.__path__)}
    for name in set(speedflags.__all__) | set(dir(speedflags)):
        if name in top_level:  # a public module (bench, report, training): the module itself
            assert getattr(speedflags, name) is importlib.import_module(f"speedflags.{name}")
    # The implementation of fast_math, speedup, tune and verify is private: importing any of
    # it rebinds no public name.
    before = {name: getattr(speedflags, name) for name in ("fast_math", "speedup", "tune")}
    for module in ("_fast_math", "_speedup", "_tune", "_tune.cli", "_verify"):
        importlib.import_module(f"speedflags.{module}")
    assert {name: getattr(speedflags, name) for name in before} == before
    assert inspect.isfunction(speedflags.fast_math) and inspect.isfunction(speedflags.tune)


@pytest.mark.parametrize("name", ["fast_optimizer", "grad_scaler", "to_device"])
def test_the_training_helpers_live_in_their_namespace_and_the_old_spelling_warns(
    name: str,
) -> None:
    assert name not in speedflags.__all__ and name not in dir(speedflags)
    helper = getattr(speedflags.training, name)
    with pytest.warns(DeprecationWarning, match=rf"speedflags\.training\.{name}"):
        old = getattr(speedflags, name)
    assert old is helper


def test_unset_is_not_public_and_means_what_none_means() -> None:
    assert "UNSET" not in speedflags.__all__ and "UNSET" not in dir(speedflags)
    with pytest.warns(DeprecationWarning, match="None"):
        unset = speedflags.UNSET
    # one meaning for "not given": the lever is left unchanged, and neither spelling turns
    # the spec into a bare fast_math() (the recommended levers)
    for blank in (None, unset):
        spec = speedflags.fast_math(tf32=blank, device="cpu")
        assert spec.levers == {}
        with spec as frame:
            assert frame.program.n == 0
    assert speedflags.fast_math(device="cpu").levers == {}  # bare: planned on entry
    recommended = speedflags.recommended("cpu").levers  # what this CPU gets (machine-dependent)
    with speedflags.fast_math(device="cpu") as frame:
        assert {lever.name for lever in frame.program.levers} == set(recommended)
