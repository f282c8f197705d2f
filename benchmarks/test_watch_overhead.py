"""What speedflags.watch() and the pytest plugin's leak check cost.

- ``watch-frame``: a fast_math frame (the levers of ``test_overhead.py``) not watching, while
  watching (each ledger boundary reads every lever's state twice) and after a watch stopped
  (nothing stays installed, so it must match "not watching").
- ``watch-write``: a Python write that changes a flag (``torch.backends.cudnn.benchmark``,
  toggled), not watching and watching (the wrapper reads the state before and after, finds
  the writer's frame and records the change on the ledger).
- ``leak-check``: what ``--speedflags-leaks`` adds to a test that leaked nothing: every
  lever's state read before and after, and compared (target: under 100 µs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags
from speedflags.pytest_plugin import LeakGuard

SPEC = speedflags.fast_math(tf32=True, amp="bf16", cudnn_benchmark=True, device="cpu")


def frame() -> None:
    with SPEC:
        pass


def toggle() -> None:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark = False


def _run(fn: Callable[[], None], calls: int) -> None:
    for _ in range(calls):
        fn()


VARIANTS = ("not-watching", "watching", "after-stop")


@pytest.mark.benchmark(group="watch-frame")
@pytest.mark.parametrize("variant", VARIANTS)
def test_frame(benchmark: Any, variant: str) -> None:
    _measure(benchmark, variant, frame, calls=200)


@pytest.mark.benchmark(group="watch-write")
@pytest.mark.parametrize("variant", VARIANTS[:2])
def test_write(benchmark: Any, variant: str) -> None:
    _measure(benchmark, variant, toggle, calls=100)  # a call is two changing writes


def _measure(benchmark: Any, variant: str, fn: Callable[[], None], calls: int) -> None:
    if variant == "after-stop":
        with speedflags.watch():
            fn()
    watch = speedflags.watch()
    if variant == "watching":
        watch.start()
    try:
        benchmark.extra_info["calls_per_round"] = calls
        benchmark.extra_info["baseline"] = variant == "not-watching"
        benchmark.pedantic(_run, args=(fn, calls), rounds=50, warmup_rounds=5)
    finally:
        watch.stop()


@pytest.mark.benchmark(group="leak-check")
def test_leak_check_per_test(benchmark: Any) -> None:
    guard = LeakGuard("fail")
    try:

        def per_test() -> None:
            before = guard.read()
            after = guard.read()
            assert after == before

        calls = 200
        benchmark.extra_info["calls_per_round"] = calls
        benchmark.extra_info["baseline"] = True
        benchmark.pedantic(_run, args=(per_test, calls), rounds=50, warmup_rounds=5)
    finally:
        guard.close()
