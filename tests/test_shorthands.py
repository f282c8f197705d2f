"""The shorthands are made from the levers' declarations, and ``_shorthands.pyi`` (their
typed face for mypy and editors) says what they are: the same names, parameters and
defaults, as ``LeverArgs`` says what the keywords are."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import speedflags
from speedflags import _shorthands
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers.registry import REGISTRY

STUB = Path(_shorthands.__file__).with_suffix(".pyi")
DECLARED = {s.shorthand.name: s for s in REGISTRY if s.builtin and s.shorthand is not None}


def _stub_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(STUB.read_text(encoding="utf-8"))
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name != "make_shorthand"
    }


def _stub_parameters(node: ast.FunctionDef) -> list[tuple[str, str, Any]]:
    args = node.args
    out: list[tuple[str, str, Any]] = []
    plain = args.args
    defaults = [None] * (len(plain) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(plain, defaults, strict=True):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", value))
    if args.vararg is not None:
        out.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "KEYWORD_ONLY", value))
    return out


def test_the_stub_names_exactly_the_declared_shorthands() -> None:
    assert set(_stub_functions()) == set(DECLARED) == set(_shorthands.MADE)
    for name in DECLARED:
        assert getattr(speedflags, name) is _shorthands.MADE[name]
        assert name in speedflags.__all__


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_each_stub_has_the_made_functions_parameters_and_defaults(name: str) -> None:
    made = inspect.signature(getattr(speedflags, name))
    found = [(p.name, p.kind.name, p.default) for p in made.parameters.values()]
    assert _stub_parameters(_stub_functions()[name]) == found


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_each_shorthand_has_the_declared_docstring_with_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(speedflags, name))
    assert doc is not None and "Example:" in doc and "Scope:" in doc
    assert doc.startswith(inspect.cleandoc(DECLARED[name].shorthand.doc).splitlines()[0])


def test_labels_name_the_call_as_written() -> None:
    assert speedflags.tf32()._label == "tf32(True)"
    assert speedflags.sdpa_backend("flash", "math")._label == "sdpa_backend('flash', 'math')"
    assert speedflags.autocast("bf16", "cpu")._label == "autocast('bf16', device='cpu')"
    assert speedflags.matmul_precision("high", label="mine")._label == "mine"
    assert speedflags.deterministic("warn").levers == {"deterministic": "warn"}


def test_a_bad_call_is_refused_naming_the_shorthand_and_its_argument() -> None:
    with pytest.raises(InvalidTypeError, match=r"tf32\(enabled='on'\): expected True or False"):
        speedflags.tf32("on")
    with pytest.raises(InvalidValueError, match=r"matmul_precision\(value='low'\)"):
        speedflags.matmul_precision("low")
    with pytest.raises(InvalidTypeError, match=r"tf32\(\): too many positional arguments"):
        speedflags.tf32(True, False)
    with pytest.raises(InvalidTypeError, match=r"cudnn_benchmark\(label=3\): expected a str"):
        speedflags.cudnn_benchmark(label=3)


def test_amp_off_through_its_shorthand_is_off_not_unchanged() -> None:
    # autocast(False): the value False (off) reaches fast_math, never None ("unchanged")
    with speedflags.autocast(False, device="cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert speedflags.autocast(False, device="cpu").levers == {"amp": False}
