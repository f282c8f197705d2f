"""The lever registry is the one list of levers: everything else derives from it.

The last test adds a toy lever (the sparse tensor invariant checks, a real torch flag that no
lever covers) to the registry for its duration and checks that ``fast_math``, ``@speedup``,
``Schedule``, the snapshot and the bench baseline take it with no other change.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import speedflags
from speedflags import InvalidTypeError, InvalidValueError
from speedflags._measure.configs import BASELINE_LEVERS
from speedflags.levers import registry
from speedflags.levers.guarded import GUARDED
from speedflags.levers.registry import LEVER_NAMES, REGISTRY, lever_spec


def test_names_order_and_levers_agree() -> None:
    assert LEVER_NAMES == (
        "tf32",
        "matmul_precision",
        "cudnn_benchmark",
        "sdpa",
        "deterministic",
        "reduced_precision_reduction",
        "amp",
        "param_dtype",
        "memory_format",
        "fp8",
    )
    for spec in REGISTRY:
        for device_type in ("cpu", "cuda"):
            model = torch.nn.Linear(2, 2) if spec.per_model else None
            lever = spec.lever(device_type, model)
            assert lever.name == spec.name
            assert lever.scope == spec.scope
    assert [s.shorthand.name if s.shorthand else "" for s in REGISTRY] == [
        "tf32",
        "matmul_precision",
        "cudnn_benchmark",
        "sdpa_backend",
        "deterministic",
        "reduced_precision_reduction",
        "autocast",
        "",  # the model levers need model=: fast_math(model=net, param_dtype=...)
        "",
        "",
    ]
    for spec in REGISTRY:  # the shorthand is a public function of that name
        if spec.shorthand:
            assert callable(getattr(speedflags, spec.shorthand.name))


@pytest.mark.parametrize("func", [speedflags.fast_math, speedflags.speedup])
def test_signature_and_docstring_list_every_lever(func: Any) -> None:
    params = inspect.signature(func).parameters
    for spec in REGISTRY:
        assert params[spec.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[spec.name].default is None
        # one level under the "Levers:" header, whatever the Python does with indentation
        assert "\nLevers:\n" in inspect.getdoc(func)
        assert f"\n    {spec.name}: {spec.summary}" in inspect.getdoc(func)
    assert "{levers}" not in func.__doc__


@pytest.mark.parametrize(
    "make",
    [
        lambda: speedflags.fast_math(tf33=True),
        lambda: speedflags.speedup(tf33=True),
        lambda: speedflags.FastMath(tf33=True),
    ],
)
def test_unknown_lever_names_the_valid_ones(make: Any) -> None:
    with pytest.raises(InvalidTypeError, match="unexpected keyword argument 'tf33'") as info:
        make()
    assert (
        "amp, cudnn_benchmark, deterministic, fp8, matmul_precision, memory_format, param_dtype, "
        "reduced_precision_reduction, sdpa, tf32" in str(info.value)
    )
    assert "fast_math" in str(info.value) or "speedup" in str(info.value)


def test_lever_spec_refuses_unknown_names() -> None:
    with pytest.raises(InvalidValueError, match=r"load: unknown lever 'x'; valid: amp, "):
        lever_spec("x", "load")
    with pytest.raises(InvalidValueError, match="unknown lever 3"):
        lever_spec(3)


def test_baseline_snapshot_and_candidates_come_from_the_registry() -> None:
    # the model levers' "off" needs a model: a problem with one adds it (bench's model rows)
    off = {s.name: s.baseline for s in REGISTRY if s.has_baseline and not s.per_model}
    assert dict(BASELINE_LEVERS) == off
    process_and_thread = {s.name for s in REGISTRY if not s.per_model}
    assert set(speedflags.snapshot()) == process_and_thread | {s.name for s in GUARDED}
    for spec in REGISTRY:  # every candidate and baseline is a value the lever accepts
        for value in spec.candidates + ((spec.baseline,) if spec.has_baseline else ()):
            spec.check("tune", value)


def test_check_levers_orders_drops_none_and_refuses_contradictions() -> None:
    assert registry.check_levers("f", {"amp": False, "tf32": True, "sdpa": None}) == (
        ("tf32", True),
        ("amp", None),
    )
    with pytest.raises(InvalidValueError, match=r"f\(tf32=False, matmul_precision='high'\)"):
        registry.check_levers("f", {"tf32": False, "matmul_precision": "high"})


@pytest.mark.parametrize("page", ["README.md", "docs/levers.md"])
def test_the_lever_tables_list_the_registry_in_order(page: str) -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / page
    if not path.is_file():
        pytest.skip(f"no {page} next to the tests (installed without sources)")
    text = path.read_text(encoding="utf-8")
    table = text.split("# The levers", 1)[1].split("| argument |", 1)[1]
    table = "| argument |" + table.split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    names = tuple(row.split("`")[1] for row in rows)
    assert names == LEVER_NAMES
    for row, spec in zip(rows, REGISTRY, strict=True):
        scope = "process" if spec.scope == "process" else f"**{spec.scope}**"
        assert f"| {scope} |" in row


def test_every_lever_module_that_declares_levers_is_listed_in_the_registry() -> None:
    # the registry lists the built-in levers' modules (no scan of the package): a module
    # that declares levers but is not listed would be a lever nobody can use
    import importlib
    import pkgutil

    import speedflags.levers

    declaring = {
        info.name
        for info in pkgutil.iter_modules(speedflags.levers.__path__)
        if getattr(importlib.import_module(f"speedflags.levers.{info.name}"), "DECLARED", ())
    }
    assert declaring == set(registry.BUILT_IN_MODULES)
    assert {s.name for s in REGISTRY if s.builtin} == {
        spec.name
        for name in registry.BUILT_IN_MODULES
        for spec in importlib.import_module(f"speedflags.levers.{name}").DECLARED
    }
