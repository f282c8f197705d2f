"""The typed lever keywords (speedflags/levers/arguments.py) match the registry, and a type
checker refuses a misspelled lever or a bad value at every public entry point."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mypy_disagrees, needs_mypy

import speedflags
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers.arguments import LeverArgs, lever_annotations
from speedflags.levers.registry import LEVER_NAMES, REGISTRY, lever_spec

ROOT = Path(__file__).resolve().parent.parent


def literals(annotation: Any) -> Iterator[Any]:
    """Every value a ``Literal[...]`` inside ``annotation`` names."""
    if typing.get_origin(annotation) is typing.Literal:
        yield from typing.get_args(annotation)
        return
    for arg in typing.get_args(annotation):
        yield from literals(arg)


def test_one_typed_keyword_per_lever_in_registry_order() -> None:
    assert tuple(LeverArgs.__annotations__) == LEVER_NAMES
    assert LeverArgs.__total__ is False  # every lever may be left out
    annotations = lever_annotations()
    for spec in REGISTRY:
        assert spec.annotation == annotations[spec.name], spec.name


@pytest.mark.parametrize("name", LEVER_NAMES)
def test_every_literal_value_of_a_lever_type_is_one_its_validation_accepts(name: str) -> None:
    values = list(literals(lever_annotations()[name]))
    spec = lever_spec(name)
    for value in values:
        spec.validate(value)  # raises if the type promises a value the lever refuses
    if any(isinstance(v, str) for v in values):  # a string the type does not name is refused
        with pytest.raises((InvalidValueError, InvalidTypeError)):
            spec.validate("bf17")


def test_every_lever_type_allows_none_for_leave_unchanged() -> None:
    for name, annotation in lever_annotations().items():
        assert type(None) in typing.get_args(annotation), name


@pytest.mark.parametrize(
    "entry",
    [speedflags.fast_math, speedflags.speedup, speedflags.FastMath.__init__],
    ids=["fast_math", "speedup", "FastMath"],
)
def test_the_run_time_signature_lists_every_lever_with_its_type(entry: Any) -> None:
    parameters = inspect.signature(entry).parameters
    annotations = lever_annotations()
    for name in LEVER_NAMES:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].annotation == annotations[name]


# Each line marked "# error" must be refused by mypy; every other line must pass.
SNIPPET = """\
import torch
import speedflags
from speedflags import FastMath, Schedule, fast_math, speedup

fast_math(tf32=True, matmul_precision="high", amp="bf16", sdpa=("flash", "math"))
fast_math(amp=torch.bfloat16, deterministic="warn", cudnn_benchmark=None)
speedup(amp=False, compile=True)
speedup(amp="bf16", cuda_graphs=True)
Schedule({0: {"matmul_precision": "medium"}, 10: {}})
speedflags.autocast("bf16", device="cpu")
speedflags.matmul_precision("high")
speedflags.sdpa_backend("flash", "math")
net = torch.nn.Linear(2, 2)
fast_math(model=net, param_dtype="bf16", memory_format="channels_last")
speedup(model=net, param_dtype=torch.float16, memory_format=torch.channels_last)
Schedule({0: {"param_dtype": "bf16"}, 5: {"param_dtype": False}}, model=net)
fast_math(model=net, fp8=True, param_dtype="bf16")
speedup(model=net, fp8="rowwise")
Schedule({0: {"fp8": "tensorwise"}, 5: {"fp8": False}}, model=net)
fast_math(tf33=True)  # error
fast_math(amp="bf17")  # error
fast_math(matmul_precision="low")  # error
fast_math(sdpa="flsh")  # error
fast_math(deterministic="warm")  # error
FastMath(tf33=True)  # error
speedup(ampp="bf16")  # error
speedup(amp="bf17")  # error
speedup(cuda_graphs="yes")  # error
Schedule({0: {"tf33": True}})  # error
Schedule({0: {"amp": "bf17"}})  # error
speedflags.autocast("bf17")  # error
speedflags.matmul_precision("low")  # error
speedflags.sdpa_backend("flsh")  # error
speedflags.deterministic("warm")  # error
fast_math(model=net, param_dtype="bf17")  # error
fast_math(model=net, memory_format="nhwc")  # error
Schedule({0: {"param_dtype": "bf17"}}, model=net)  # error
fast_math(model=net, fp8="fp9")  # error
speedup(model=net, fp8=3)  # error
"""


@needs_mypy
def test_mypy_refuses_a_misspelled_lever_and_a_bad_value_at_every_entry_point(
    tmp_path: Path,
) -> None:
    accepted, refused, output = mypy_disagrees(SNIPPET, tmp_path, "uses_speedflags.py")
    assert not accepted, f"mypy accepted: {accepted}\n{output}"
    assert not refused, f"mypy refused valid calls: {refused}\n{output}"


def test_a_typed_config_dict_runs() -> None:
    config: LeverArgs = {"matmul_precision": "high"}
    with speedflags.fast_math(**config):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"


def test_the_sdpa_backend_enum_pytorch_spells_backends_with_is_accepted() -> None:
    # SdpaArg admits enum.Enum for it: PyTorch's stubs declare both SDPBackend classes
    # (torch.nn.attention's, 2.2+, and torch.backends.cuda's, 2.1) as Enum subclasses.
    enum_type = getattr(getattr(torch.nn, "attention", None), "SDPBackend", None) or getattr(
        torch.backends.cuda, "SDPBackend", None
    )
    if enum_type is None:  # pragma: no cover - every supported PyTorch has one of the two
        pytest.skip(f"PyTorch {torch.__version__} has no SDPBackend enum")
    assert lever_spec("sdpa").validate(enum_type.MATH) == ("math",)
