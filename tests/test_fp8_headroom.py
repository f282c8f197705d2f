"""benchmarks/fp8_headroom.py: its call of PyTorch's scaled matmul across versions, its
tensor-wise scaling, and its dry run on a CPU (the GPU measurement is the same code)."""

from __future__ import annotations

import doctest
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "fp8_headroom.py"
HAS_FP8 = hasattr(torch, "float8_e4m3fn")
needs_fp8_dtype = pytest.mark.skipif(
    not HAS_FP8, reason=f"PyTorch {torch.__version__} has no torch.float8_e4m3fn"
)
# PyTorch 2.1 to 2.3: keyword-only, optional scales, (out, amax) returned
OLD_SCHEMA = (
    "aten::_scaled_mm(Tensor self, Tensor mat2, *, Tensor? bias=None, ScalarType? out_dtype=None, "
    "Tensor? scale_a=None, Tensor? scale_b=None, Tensor? scale_result=None) -> (Tensor, Tensor)"
)
# PyTorch 2.5 on
NEW_SCHEMA = (
    "aten::_scaled_mm(Tensor self, Tensor mat2, Tensor scale_a, Tensor scale_b, Tensor? bias=None, "
    "Tensor? scale_result=None, ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor"
)


@pytest.fixture(scope="module")
def fp8() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fp8_headroom", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fp8_headroom"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_scripts_examples_run(fp8: ModuleType) -> None:
    result = doctest.testmod(fp8, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_call_form_is_read_from_the_operator_schema(fp8: ModuleType) -> None:
    old, new = fp8.scaled_mm_form(OLD_SCHEMA), fp8.scaled_mm_form(NEW_SCHEMA)
    assert (old.returns_tuple, old.fast_accum, old.scales_keyword_only) == (True, False, True)
    assert (new.returns_tuple, new.fast_accum, new.scales_keyword_only) == (False, True, False)
    # without tensor-wise scales (an unrelated operator's schema): no form
    assert fp8.scaled_mm_form("aten::mm(Tensor self, Tensor mat2) -> Tensor") is None
    here = fp8.scaled_mm_form()
    assert (here is not None) == hasattr(torch, "_scaled_mm")


def test_what_stops_fp8_is_named(fp8: ModuleType) -> None:
    form = fp8.scaled_mm_form(NEW_SCHEMA)
    assert fp8.fp8_missing((9, 0), form, True) == ""
    assert fp8.fp8_missing((8, 9), form, True) == ""  # Ada
    assert "8.6" in fp8.fp8_missing((8, 6), form, True)
    assert fp8.fp8_missing(None, form, True) == "no CUDA GPU"
    assert "_scaled_mm" in fp8.fp8_missing((9, 0), None, True)
    assert "float8_e4m3fn" in fp8.fp8_missing((9, 0), form, False)


@needs_fp8_dtype
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_tensor_wise_scaling_keeps_any_magnitude_finite_and_close(
    fp8: ModuleType, magnitude: float
) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * magnitude
    q, scale = fp8.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.dim() == 0
    back = q.float() * scale
    assert bool(torch.isfinite(back).all())
    assert float(back.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, relative, above the
    # subnormals (the scale puts the largest at 448)
    normal = x.abs() > float(x.abs().max()) / 448 * 2**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2**-4 + 1e-6
    # unscaled, neither end survives the cast (NaN or saturated at 448 above, zeros or
    # subnormals below): the scale is what keeps them
    if magnitude != 1.0:
        unscaled = fp8.relative_error(x.to(torch.float8_e4m3fn).float(), x.double())
        assert not unscaled < 0.1


@needs_fp8_dtype
def test_an_all_zero_tensor_gets_a_finite_scale(fp8: ModuleType) -> None:
    q, scale = fp8.quantize(torch.zeros(16, 16))
    assert float(scale) > 0 and bool(torch.isfinite(q.float()).all())


@needs_fp8_dtype
def test_the_pre_2_5_tuple_is_unpacked(fp8: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch 2.1 to 2.4 return (out, amax); their scaled matmul runs on CUDA only, so a CPU
    # cannot show it: a stand-in with that return, checking the arguments passed by keyword
    seen: dict[str, Any] = {}

    def old_scaled_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> tuple[Any, Any]:
        seen.update(kwargs)
        out = (a.float() @ b.float() * kwargs["scale_a"] * kwargs["scale_b"]).to(
            kwargs["out_dtype"]
        )
        return out, torch.tensor(0.0)

    monkeypatch.setattr(torch, "_scaled_mm", old_scaled_mm, raising=False)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    (qa, sa), (qb, sb) = fp8.quantize(a), fp8.quantize(b)
    out = fp8.scaled_mm(qa, qb.t(), sa, sb)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert set(seen) == {"scale_a", "scale_b", "out_dtype"}  # no use_fast_accum unless asked
    assert fp8.relative_error(out, a.double() @ b.double().t()) < 0.1


def test_errors_out_of_range_or_not_finite_are_problems(fp8: ModuleType) -> None:
    rows = [
        {"config": "fp8", "size": 64, "arithmetic": "fp8", "rel_error": 0.04},
        {"config": "bf16", "size": 64, "arithmetic": "bf16", "rel_error": 0.5},
        {"config": "fp8-fast-accum", "size": 64, "arithmetic": "fp8", "rel_error": math.nan},
    ]
    assert [p.split(":")[0] for p in fp8._problems(rows)] == [
        "bf16 at 64",
        "fp8-fast-accum at 64",
    ]


def test_without_an_fp8_gpu_it_dry_runs_on_the_cpu_and_says_so(
    fp8: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out" / "fp8.json"
    code = fp8.main(["--device", "cpu", "--sizes", "32,48", "--rounds", "2", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("fp8 headroom: not measured") and "dry run" in last
    data = json.loads(path.read_text())
    assert data["format"] == "speedflags-fp8-headroom/1"
    assert data["settings"]["dry_run"] is True and data["settings"]["sizes"] == [32, 48]
    by = {(r["size"], r["config"]): r for r in data["results"]}
    for size in (32, 48):
        assert by[(size, "fp32")]["rel_error"] < 1e-5
        assert 1e-4 < by[(size, "bf16")]["rel_error"] < 1e-2
        assert by[(size, "bf16")]["speedup_vs_bf16"] == 1.0
    if data["fp8_rows_skipped"] is None:  # this PyTorch has a CPU scaled matmul
        for size in (32, 48):
            # e4m3's 3 mantissa bits: a few percent, far from bf16's and from a broken scale
            assert 1e-2 < by[(size, "fp8")]["rel_error"] < 0.1
            assert 1e-2 < by[(size, "fp8-with-casts")]["rel_error"] < 0.1
        assert "fp8" in {r["arithmetic"] for r in data["results"]}
    else:
        assert "has no CPU kernel" in data["fp8_rows_skipped"]
        assert "fp8 rows not run" in out
    assert data["problems"] == []


def test_bad_sizes_are_usage_errors(fp8: ModuleType) -> None:
    for sizes in ("30", "0", "x"):
        with pytest.raises(SystemExit) as exc:
            fp8.main(["--device", "cpu", "--sizes", sizes])
        assert exc.value.code == 2
