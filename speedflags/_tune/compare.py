"""When one timing beats another: paired passes, their spread, and the minimum gain.

The arithmetic is shared with ``bench`` and the examples (:mod:`speedflags._measure.noise`):
two candidates timed in the same interleaved passes are compared pass by pass, each pass
giving one ratio of their medians; the speedup is the geometric mean of the ratios and its
noise the standard error of their logarithms. With fewer than three paired passes (the short
timing), the pooled medians are compared instead, each median's standard error estimated
from its rounds. A candidate is faster "beyond the noise" when its gain exceeds both
:data:`MIN_GAIN` and :data:`Z` times that noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._measure.noise import MIN_GAIN, Z, faster_beyond_noise, speedup_and_noise
from .._measure.noise import median_error as _median_error
from .._measure.timing import Timing

__all__ = ["MIN_GAIN", "Effort", "Z", "compare", "faster", "median_error"]


@dataclass(frozen=True)
class Effort:
    """How hard each timing works (the defaults when no ``seconds`` bound is given)."""

    short_s: float = 0.15  # timed seconds per candidate in the short round
    short_rounds: int = 5
    long_s: float = 1.2  # timed seconds per candidate in the long round, all passes
    long_rounds: int = 18
    passes: int = 6  # of the long round
    warmup_rounds: int = 2
    warmup_s: float = 0.05
    duel_s: float = 20.0  # measured seconds of calls a duel may add (speedflags._tune.duel)
    duel_min_blocks: int = 4
    duel_max_blocks: int = 40


def median_error(timing: Timing | None) -> float:
    """The relative standard error of ``timing``'s median (``inf`` under 3 rounds).

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> round(median_error(Timing.of([[0.9, 1.0, 1.0, 1.1]])), 3)
        0.023
    """
    if timing is None:
        return math.inf
    quartiles = timing.quartiles
    q1, q3 = quartiles if quartiles is not None else (None, None)
    return _median_error(timing.median, q1, q3, timing.rounds)


def compare(fast: Timing | None, slow: Timing | None) -> tuple[float, float]:
    """``(speedup, noise)`` of ``fast`` over ``slow``: ``slow``'s time over ``fast``'s.

    Paired by pass when both have the same three passes or more, else from the pooled
    medians; ``noise`` is the relative standard error of the speedup (``inf``: unknown).

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> fp32 = Timing.of([[1.0, 1.0], [3.0, 3.0], [1.2, 1.2]])  # a busy second pass
        >>> amp = Timing.of([[0.5, 0.5], [1.5, 1.5], [0.6, 0.6]])
        >>> speedup, noise = compare(amp, fp32)
        >>> round(speedup, 6), round(noise, 6)
        (2.0, 0.0)
    """
    if fast is None or slow is None or fast.median <= 0 or slow.median <= 0:
        return math.nan, math.inf
    return speedup_and_noise(
        fast.pass_medians, slow.pass_medians, fast.median, slow.median,
        median_error(fast), median_error(slow),
    )  # fmt: skip


def faster(fast: Timing | None, slow: Timing | None) -> bool:
    """Whether ``fast`` beats ``slow`` beyond the noise, and by :data:`MIN_GAIN` at least:
    :func:`~speedflags._measure.noise.faster_beyond_noise` of their :func:`compare`, the test
    whose other side marks a row within the noise (``~``), so no row is both.

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> fp32 = Timing.of([[1.0, 1.02], [0.98, 1.01], [1.0, 0.99]])
        >>> faster(Timing.of([[0.6, 0.61], [0.59, 0.6], [0.62, 0.6]]), fp32)
        True
        >>> faster(Timing.of([[0.99, 1.0], [0.98, 0.97], [1.01, 1.0]]), fp32)  # under 3 %
        False
        >>> faster(Timing.of([[0.5, 0.5], [1.1, 1.1], [0.6, 0.6]]), fp32)  # too noisy
        False
    """
    return faster_beyond_noise(*compare(fast, slow))
