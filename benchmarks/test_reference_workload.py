"""The reference workload, the 3×Linear(d, d) AdamW train step: ``Linear(d, d)`` x3, batch
512, one AdamW train step.

A published laptop benchmark reports 1.41x for ``fast_math(tf32=True, amp="bf16")`` over
fp32 on an RTX 4050 Laptop at d = 8192; this measures what the same step gets here (d = 4096
and 8192 on a GPU; 1024 and 2048 on a CPU, where TF32 has no effect and bf16 autocast does
the work). The error is that of the first layer's weight gradient against a float64 copy of
the model.
"""

from __future__ import annotations

from collections.abc import Callable

WORKLOAD = "mlp-train"


def test_train_step(
    measure: Callable[[str, int, str], float | None], device: str, size: int, config: str
) -> None:
    measure(device, size, config)
