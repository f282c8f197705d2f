"""What @speedup adds per call, next to fast_math, on a step that does nothing.

The goal (issue 3): @speedup's per-call overhead within 1.5x of fast_math's, with the same
levers, measured side by side in one run. ``speedup-compile`` is the same empty step
compiled (backend "eager"): what the compile guard plus dynamo's own dispatch cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import speedflags

LEVERS: dict[str, Any] = dict(tf32=True, amp="bf16", cudnn_benchmark=True, device="cpu")
SPEC = speedflags.fast_math(**LEVERS)


def with_fast_math() -> None:
    with SPEC:
        pass


@SPEC
def fast_math_decorated() -> None:
    pass


@speedflags.speedup(**LEVERS)
def speedup_decorated() -> None:
    pass


@speedflags.speedup(**LEVERS, inference=True)
def speedup_inference() -> None:
    pass


@speedflags.speedup(**LEVERS, compile={"backend": "eager"})
def speedup_compiled() -> None:
    pass


VARIANTS: dict[str, Callable[[], None]] = {
    "fast_math-decorated": fast_math_decorated,
    "fast_math-with": with_fast_math,
    "speedup": speedup_decorated,
    "speedup-inference": speedup_inference,
    "speedup-compile": speedup_compiled,
}


def _run(fn: Callable[[], None], calls: int) -> None:
    for _ in range(calls):
        fn()


@pytest.mark.benchmark(group="speedup-overhead")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speedup_overhead(benchmark: Any, variant: str) -> None:
    calls = 200  # per round: one call is too short for the timer to resolve
    before = speedflags.snapshot()
    fn = VARIANTS[variant]
    fn()  # the compiled variant compiles here, outside the timing
    benchmark.extra_info["levers"] = "tf32=True, amp='bf16', cudnn_benchmark=True, device='cpu'"
    benchmark.extra_info["calls_per_round"] = calls
    benchmark.pedantic(_run, args=(fn, calls), rounds=100, warmup_rounds=10)
    assert speedflags.snapshot() == before
    if variant == "speedup-compile":
        assert speedup_compiled.stats.mode == "compiled"  # type: ignore[attr-defined]
