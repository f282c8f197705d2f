"""An emulated candidate, timed once: what it would cost, shown, never raced.

bf16 autocast on a CPU without bf16 instructions computes in bf16, tens of times slower
than fp32. ``tune`` does not race such a candidate (it cannot win), but a table that only
said "skipped" would leave a user wondering why nothing is recommended; so, after the
singles, each one gets its error (one call, which also warms it up) and one timed call beside
one timed call of fp32, and its row says "in effect, emulated: slower" with both times.
"""

from __future__ import annotations

from collections.abc import Callable

from .._measure.rounds import measure_rounds, warm_up
from .._measure.vocabulary import EMULATED
from .entry import Candidate, StepRunner
from .result import ms

__all__ = ["time_once"]


def time_once(
    fp32: Candidate,
    entry: Candidate,
    *,
    runner: Callable[[Candidate], StepRunner],
    check: Callable[[Candidate], None],
    clock: Callable[[], float],
    left: Callable[[], float],
    say: Callable[[str], None],
) -> None:
    """Time ``entry`` (an emulated candidate whose row note holds the reason) once beside
    fp32; mark its row, which is never accepted. ``check(entry)`` measures its error (and
    may reject it), ``runner(entry)`` runs its step; ``clock``, ``left`` and ``say`` as for
    :func:`~speedflags._tune.duel.duel`."""
    row = entry.row
    row.verdict = EMULATED
    reason = row.note
    if left() <= 0:
        row.note = f"{EMULATED} (not timed: out of time): {reason}"
        return
    check(entry)
    if entry.rejected:
        row.note = f"{EMULATED}; {row.note}: {reason}"
        return
    times = []
    for timed in (fp32, entry):
        step = runner(timed)
        if timed is fp32:  # the emulated one was warmed up by its error's call
            warm_up(step, clock, 1, 0.0)
        times.append(min(measure_rounds(step, clock, 1)))
    row.median_s, row.rounds = times[1], 1
    row.speedup = times[0] / times[1] if times[1] > 0 else None
    row.note = f"{EMULATED}: timed once ({ms(times[1])}, fp32 {ms(times[0])}): {reason}"
    say(f"{row.label}: emulated, {row.speedup or 0:.2g}x of fp32 in one call")
