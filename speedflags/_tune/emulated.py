"""An emulated candidate, timed once: what it would cost, shown, never raced.

bf16 autocast on a CPU without bf16 instructions computes in bf16, tens of times slower
than fp32. ``tune`` does not race such a candidate (it cannot win), but a table that only
said "skipped" would leave a user wondering why nothing is recommended; so, after the
singles, each one gets its error (one call, which also warms it up) and one timed call beside
one timed call of fp32, and its row says "in effect, emulated: slower" with both times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._measure.rounds import measure_rounds, warm_up
from .._measure.vocabulary import EMULATED
from .entry import Entry, StepRunner
from .result import ms

if TYPE_CHECKING:
    from .search import Search

__all__ = ["time_once"]


def time_once(search: Search, fp32: Entry, entry: Entry) -> None:
    """Time ``entry`` (an emulated candidate whose row note holds the reason) once beside
    fp32; mark its row, which is never accepted."""
    row = entry.row
    row.verdict = EMULATED
    reason = row.note
    if search.left() <= 0:
        row.note = f"{EMULATED} (not timed: out of time): {reason}"
        return
    search._check(entry)
    if entry.rejected:
        row.note = f"{EMULATED}; {row.note}: {reason}"
        return
    times = []
    for timed in (fp32, entry):
        runner = StepRunner(search._step(timed), search)
        if timed is fp32:  # the emulated one was warmed up by its error's call
            warm_up(runner, search.clock, 1, 0.0)
        times.append(min(measure_rounds(runner, search.clock, 1)))
    row.median_s, row.rounds = times[1], 1
    row.speedup = times[0] / times[1] if times[1] > 0 else None
    row.note = f"{EMULATED}: timed once ({ms(times[1])}, fp32 {ms(times[0])}): {reason}"
    search.say(f"{row.label}: emulated, {row.speedup or 0:.2g}x of fp32 in one call")
