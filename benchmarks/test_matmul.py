"""Float32 matmul under every lever, against the fp32 baseline and the bf16/fp16 ceiling.

Configurations (``speedflags.bench.WORKLOADS["matmul"].configs``): ``fp32`` (the baseline:
TF32 off, precision ``"highest"``), ``tf32``, ``precision-high``, ``precision-medium``,
``amp-bf16``, ``amp-fp16``, and ``pure-bf16``/``pure-fp16`` (inputs already in that dtype:
the ceiling autocast should approach). Sizes: 1024 and 2048 on a CPU, 4096 and 8192 on a
GPU. Each records its FLOP/s and its relative error against a float64 product of the same
inputs; TF32 without an Ampere+ GPU and fp16 on a CPU are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

WORKLOAD = "matmul"


def test_matmul(
    measure: Callable[[str, int, str], float | None], device: str, size: int, config: str
) -> None:
    measure(device, size, config)
