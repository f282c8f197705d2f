"""What a configuration costs in accuracy: relative error against a float64 reference.

The metric is the relative Frobenius error ``||out - ref|| / ||ref||``, with ``ref``
computed in float64 from the same inputs. It is what ``research/perf.md`` reports: about
2.5e-7 for float32, 3e-4 for TF32 or fp16 inputs, 2.4e-3 to 2.9e-3 for bf16.
"""

from __future__ import annotations

from typing import Dict

import torch

__all__ = ["TOLERANCE", "relative_error"]

# Upper bounds a correct run stays under (about ten times the expected error): a benchmark
# that exceeds one measured something other than what it claims.
TOLERANCE: Dict[str, float] = {
    "fp32": 1e-4,
    "tf32": 1e-2,
    "fp16": 1e-2,
    "bf16": 5e-2,
}
_ORDER = ("fp32", "tf32", "fp16", "bf16")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F``, computed in float64 on ``ref``'s device.

    Example:
        >>> import torch
        >>> from speedflags.bench.accuracy import relative_error
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
        >>> from speedflags.bench.accuracy import coarsest
        >>> coarsest("fp32", "bf16", "tf32")
        'bf16'
    """
    return max(precisions, key=_ORDER.index)
