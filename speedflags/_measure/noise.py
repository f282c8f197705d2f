"""How far apart two interleaved timings are, and whether that is more than their noise.

Two configurations timed in the same interleaved passes are compared pass by pass: each
pass gives one ratio of their medians, taken within seconds of each other, so a neighbour's
load that comes and goes hits both sides of a ratio alike. The speedup is the geometric mean
of the ratios; its noise is the standard error of their logarithms (``stdev / √passes``,
about the relative error of the speedup). With fewer than three paired passes, the pooled
medians are compared instead, each median's standard error estimated from its rounds
(1.253 σ / √n, σ from the interquartile range, which one slow outlier does not move).

A difference is *within its noise* when it is under both :data:`MIN_GAIN` and :data:`Z`
times that noise: ``bench``, ``tune`` and the examples then say so instead of letting a
figure stand alone. A speedup is *faster beyond the noise* (:func:`faster_beyond_noise`, what
``tune`` accepts) exactly when it is above 1 and not within its noise: both tests measure the
gain on one scale, its logarithm, so no figure can be both.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "MIN_GAIN",
    "Z",
    "faster_beyond_noise",
    "median_error",
    "paired",
    "speedup_and_noise",
    "within_noise",
]

MIN_GAIN = 0.03  # below a 3 % gain a lever is not worth its accuracy cost, whatever the noise
Z = 2.5  # about a 97.5 % one-sided bound with six passes (Student's t, 5 degrees of freedom)


def median_error(median: float, q1: float | None, q3: float | None, rounds: int) -> float:
    """The relative standard error of a median of ``rounds`` times (``inf`` under 3 rounds).

    Example:
        >>> from speedflags._measure.noise import median_error
        >>> round(median_error(1.0, 0.975, 1.025, 4), 3)
        0.023
    """
    if q1 is None or q3 is None or rounds < 3 or median <= 0:
        return math.inf
    sigma = (q3 - q1) / 1.349
    return 1.253 * sigma / math.sqrt(rounds) / median


def paired(fast: Sequence[float], slow: Sequence[float]) -> tuple[float, float] | None:
    """``(speedup, noise)`` from per-pass medians, or None under three paired passes.

    Example:
        >>> from speedflags._measure.noise import paired
        >>> speedup, noise = paired([0.5, 1.5, 0.6], [1.0, 3.0, 1.2])  # a busy second pass
        >>> round(speedup, 6), round(noise, 6)
        (2.0, 0.0)
    """
    if len(fast) != len(slow) or len(fast) < 3 or min(fast) <= 0 or min(slow) <= 0:
        return None
    logs = [math.log(s / f) for f, s in zip(fast, slow, strict=True)]
    return math.exp(statistics.fmean(logs)), statistics.stdev(logs) / math.sqrt(len(logs))


def speedup_and_noise(
    fast_passes: Sequence[float],
    slow_passes: Sequence[float],
    fast_median: float,
    slow_median: float,
    fast_error: float,
    slow_error: float,
) -> tuple[float, float]:
    """``(speedup, noise)`` of ``fast`` over ``slow``: paired by pass where three or more
    passes pair up, else the pooled medians with their standard errors (``inf``: unknown).

    Example:
        >>> from speedflags._measure.noise import speedup_and_noise
        >>> speedup_and_noise([1.0], [2.0], 1.0, 2.0, 0.01, 0.02)[0]
        2.0
    """
    found = paired(fast_passes, slow_passes)
    if found is not None:
        return found
    if fast_median <= 0 or slow_median <= 0:
        return math.nan, math.inf
    return slow_median / fast_median, math.hypot(fast_error, slow_error)


def within_noise(speedup: float, noise: float) -> bool:
    """Whether ``speedup`` (faster or slower) is no difference beyond the noise: under
    :data:`MIN_GAIN` either way, or under :data:`Z` times ``noise``. False where the noise
    is unknown (``inf``: too few rounds to tell), which says nothing either way.

    Example:
        >>> from speedflags._measure.noise import within_noise
        >>> within_noise(1.02, 0.001), within_noise(1.5, 0.01), within_noise(1.3, 0.2)
        (True, False, True)
        >>> within_noise(0.5, 0.01), within_noise(1.01, float("inf"))
        (False, False)
    """
    if not math.isfinite(speedup) or speedup <= 0 or not math.isfinite(noise):
        return False
    return abs(math.log(speedup)) <= _threshold(noise)


def faster_beyond_noise(speedup: float, noise: float) -> bool:
    """Whether ``speedup`` is a gain beyond the noise: over :data:`MIN_GAIN` and over
    :data:`Z` times ``noise``, on the scale :func:`within_noise` measures on, so that a
    speedup above 1 is exactly one of the two. False where the noise is unknown.

    Example:
        >>> from speedflags._measure.noise import faster_beyond_noise, within_noise
        >>> faster_beyond_noise(1.5, 0.01), faster_beyond_noise(1.3, 0.2)
        (True, False)
        >>> speedup, noise = 1.27, 0.1  # 27 % over 2.5 x 10 %, but log(1.27) is not
        >>> faster_beyond_noise(speedup, noise), within_noise(speedup, noise)
        (False, True)
    """
    if not math.isfinite(speedup) or speedup <= 0 or not math.isfinite(noise):
        return False
    return math.log(speedup) > _threshold(noise)


def _threshold(noise: float) -> float:
    # the smallest gain, as a logarithm, that is told apart from no difference
    return max(math.log1p(MIN_GAIN), Z * noise)
