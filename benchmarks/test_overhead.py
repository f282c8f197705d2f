"""What entering and leaving a fast_math block costs, next to the same levers in plain torch.

``@speedup`` enters a frame every training step, so this is a hot path. The plain-torch
variant sets and restores the same three levers the way a careful user would by hand
(legacy TF32 attributes, cudnn.benchmark, torch.autocast); it checks nothing and records
nothing. Goal: fast_math at most 2x of it (RESULTS.md has each run; the earlier 1.5x is
not met).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags

SPEC = speedflags.fast_math(tf32=True, amp="bf16", cudnn_benchmark=True, device="cpu")


def plain_torch() -> None:
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pass
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.backends.cudnn.benchmark = benchmark


def with_fast_math() -> None:
    with SPEC:
        pass


@SPEC
def decorated() -> None:
    pass


VARIANTS: dict[str, Callable[[], None]] = {
    "plain-torch": plain_torch,
    "fast_math": with_fast_math,
    "decorated": decorated,
}


def _run(fn: Callable[[], None], calls: int) -> None:
    for _ in range(calls):
        fn()


@pytest.mark.benchmark(group="enter-exit")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_enter_exit(benchmark: Any, variant: str) -> None:
    calls = 200  # per round: one call is too short for the timer to resolve
    before = speedflags.snapshot()
    benchmark.extra_info["levers"] = "tf32=True, amp='bf16', cudnn_benchmark=True, device='cpu'"
    benchmark.extra_info["calls_per_round"] = calls
    benchmark.pedantic(_run, args=(VARIANTS[variant], calls), rounds=100, warmup_rounds=10)
    # Plain torch leaves a residue (the cuBLAS fp32_precision node reads 'ieee' where it read
    # 'none'); speedflags restores every getter. Recorded, and checked for speedflags only.
    exact = speedflags.snapshot() == before
    benchmark.extra_info["restores_exactly"] = exact
    if variant != "plain-torch":
        assert exact
    speedflags.snapshot()  # the next variant starts from whatever this one left
