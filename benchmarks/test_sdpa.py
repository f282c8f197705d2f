"""``scaled_dot_product_attention`` with each backend the device offers, against ``math``.

CPU: the math and flash (CPU) kernels, float32. GPU: math, flash, memory-efficient and
cuDNN, in bf16 (fp16 before Ampere). A backend that refuses the inputs is skipped with
PyTorch's reason instead of silently timing the math fallback.
"""

from __future__ import annotations

from collections.abc import Callable

WORKLOAD = "sdpa"


def test_sdpa(
    measure: Callable[[str, int, str], float | None], device: str, size: int, config: str
) -> None:
    measure(device, size, config)
