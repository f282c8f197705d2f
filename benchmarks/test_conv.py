"""A 3x3 convolution with and without ``cudnn_benchmark`` (and TF32), on a CUDA GPU.

The first call per shape with ``cudnn_benchmark=True`` autotunes; it falls in the warm-up.
On a CPU there is no cuDNN, so every case skips with that reason.
"""

from __future__ import annotations

from collections.abc import Callable

WORKLOAD = "conv"


def test_conv(
    measure: Callable[[str, int, str], float | None], device: str, size: int, config: str
) -> None:
    measure(device, size, config)
