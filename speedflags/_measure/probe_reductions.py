"""The ``reduced_precision_reduction`` probe: a long fp16 and a long bf16 GEMM, with and
without reduced-precision reductions, on CUDA.

A GEMM with a small output and a long reduction (64 x 64, k = 65536) is the shape cuBLAS
splits along k; with reduced-precision reductions allowed the split's partial sums may be
added in fp16/bf16, which changes the result's bits and its error against float64. The
flags only *allow* it: cuBLAS's heuristics choose, so a GPU and cuBLAS that pick no such
kernel for this shape show no difference: with the flags reading as asked, that is "no
effect here" with that reason (measured on an H200 with PyTorch 2.11: cuBLAS kept fp32
reductions, bit-identical results), and "requested but not in effect" only when the flags do
not read as asked. On a CPU the probe does not run: the flags have no effect there.
"""

from __future__ import annotations

from typing import Any

import torch

from ..levers.lever_sets import with_baseline
from ..levers.reductions import read_state
from ..levers.registry import lever_spec
from .evidence import Observation, inputs, relative_error

GEMM_SHAPE = (64, 65536, 64)  # m, k, n
# ctx is a probes.Context, typed Any: probes imports this module
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _gemms(ctx: Any, value: bool) -> dict[str, tuple[torch.Tensor, float]]:
    m, k, n = GEMM_SHAPE
    a32, b32 = inputs([(m, k), (k, n)], ctx.device)
    out: dict[str, tuple[torch.Tensor, float]] = {}
    levers = with_baseline((("reduced_precision_reduction", value),))
    with ctx.frame(levers, f"reduced_precision_reduction={value!r}"), torch.no_grad():
        for name, dtype in _DTYPES.items():
            a, b = a32.to(dtype), b32.to(dtype)
            got = a @ b
            torch.cuda.synchronize(ctx.device)
            out[name] = (got, relative_error(got.float(), a.double() @ b.double()))
    return out


def reduced_precision_reduction(ctx: Any, value: bool) -> Observation | None:
    """fp16/bf16 GEMM results with the lever's value against fp32 reductions (CUDA only)."""
    if not ctx.cuda:
        return None
    asked = _gemms(ctx, value)
    control = _gemms(ctx, False)
    with ctx.frame(with_baseline((("reduced_precision_reduction", value),)), "(read)"):
        inside = {"flags": lever_spec("reduced_precision_reduction").current()}
        fp16, bf16, _ = read_state()
    measured: dict[str, Any] = {}
    parts = []
    differs = False
    for name in _DTYPES:
        got, error = asked[name]
        same = bool(torch.equal(got, control[name][0]))
        differs = differs or not same
        measured[f"{name}_error"] = error
        measured[f"{name}_control_error"] = control[name][1]
        measured[f"{name}_identical"] = same
        parts.append(
            f"{name} error {error:.1e} (fp32 reductions: {control[name][1]:.1e}"
            f"{', bit-identical' if same else ''})"
        )
    m, k, n = GEMM_SHAPE
    figure = f"{m}x{k} @ {k}x{n}: " + "; ".join(parts)
    unused = ""
    if value and not differs:
        figure += "; cuBLAS chose no reduced-precision reduction for this shape"
        if fp16[0] and bf16[0]:  # allowed, and cuBLAS did not take it
            unused = (
                "a permission cuBLAS did not take: with reduced-precision reductions allowed "
                f"it kept fp32 reductions for this {m}x{k} @ {k}x{n} GEMM on this GPU"
            )
    # False is the control itself: in effect when the fp32-reduction results are reproduced
    return Observation(differs if value else True, figure, measured, inside, unused)
