"""What a configuration costs in accuracy: relative error against a float64 reference.

The metric is the relative Frobenius error ``||out - ref|| / ||ref||``, with ``ref``
computed in float64 from the same inputs. Measured on a CPU (``benchmarks/RESULTS.md``):
2.5e-7 to 5.7e-7 in float32 (MKL or oneDNN), 2.9e-3 for a bf16 matmul and 5.2e-3 to 5.4e-3
for a bf16 train step's gradient. TF32 and fp16 inputs (not measured here: no GPU) round to
the same unit, about 3e-4. ``docs/performance.md`` explains these levels.
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCE", "relative_error"]

# Upper bounds a correct run stays under, asserted by the pytest suites in benchmarks/: a run
# above one measured something other than what it claims. They sit about 200x above the
# largest fp32 error measured, 30x above the expected TF32/fp16 error and 10x above the
# largest bf16 error measured; the fp32 bound stays below TF32's ~3e-4, so an "fp32" run that
# silently used TF32 or bf16 fails.
TOLERANCE: dict[str, float] = {
    "fp32": 1e-4,
    "tf32": 1e-2,
    "fp16": 1e-2,
    "bf16": 5e-2,
    # FP8 (e4m3 keeps 3 mantissa bits) measured 7e-2 on linear-infer's output and 1.0e-1 on
    # mlp-train's weight gradient (tensorwise casts the output gradient to e5m2), emulated
    "fp8": 3e-1,
}
_ORDER = ("fp32", "tf32", "fp16", "bf16", "fp8")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F``, computed in float64 on ``ref``'s device.

    Example:
        >>> import torch
        >>> from speedflags._measure.accuracy import relative_error
        >>> ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
        >>> relative_error(torch.tensor([3.0, 4.5]), ref)
        0.1
        >>> relative_error(ref.bfloat16(), ref)
        0.0
    """
    diff = out.detach().to(device=ref.device, dtype=torch.float64) - ref
    norm = float(torch.linalg.vector_norm(ref))
    if norm == 0.0:
        return float(torch.linalg.vector_norm(diff))
    return float(torch.linalg.vector_norm(diff)) / norm


def coarsest(*precisions: str) -> str:
    """The least precise of several precision classes (``"fp32"`` < ``"tf32"`` < ... < ``"bf16"``).

    Example:
        >>> from speedflags._measure.accuracy import coarsest
        >>> coarsest("fp32", "bf16", "tf32")
        'bf16'
    """
    return max(precisions, key=_ORDER.index)
