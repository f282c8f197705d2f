"""Warm-up and timed rounds: how ``bench``, the benchmark suites and ``tune`` call a runner.

A :class:`~speedflags._measure.problems.Runner` gives the next input set (``setup()``,
outside the clock) and the timed call (``run(*inputs)``); ``clock`` is a timer that waits for
the device (:func:`~speedflags._measure.timing.timer_for`).
"""

from __future__ import annotations

from collections.abc import Callable

from .problems import Runner

__all__ = ["Clock", "measure_rounds", "warm_up"]

Clock = Callable[[], float]


def warm_up(runner: Runner, clock: Clock, rounds: int, seconds: float) -> float:
    """Call ``runner`` at least ``rounds`` times and ``seconds`` long; return a per-call estimate.

    The estimate is the fastest call after the first (which pays first-call costs: cuBLAS
    handles, cuDNN autotuning, allocator growth).
    """
    times: list[float] = []
    began = clock()
    while len(times) < max(rounds, 1) or (clock() - began < seconds and len(times) < 10_000):
        inputs = runner.setup()
        start = clock()
        runner.run(*inputs)
        times.append(clock() - start)
    return min(times[1:]) if len(times) > 1 else times[0]


def measure_rounds(runner: Runner, clock: Clock, rounds: int, calls: int = 1) -> list[float]:
    """Time ``rounds`` rounds of ``calls`` calls; return the time per call of each round.

    Every call takes the next input set, picked before the clock starts. ``clock`` must
    wait for the device's queued work (:func:`~speedflags._measure.timing.timer_for`), so
    the start reading comes after earlier work and the end reading after the round's
    kernels.
    """
    times = []
    for _ in range(rounds):
        batch = [runner.setup() for _ in range(calls)]
        start = clock()
        for inputs in batch:
            runner.run(*inputs)
        times.append((clock() - start) / calls)
    return times
