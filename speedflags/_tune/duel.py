"""When the noise is large: the top candidates timed call by call, paired, until it is clear.

The search's timings run each candidate as a block of rounds, one candidate after another
(as a training loop runs a configuration). On a quiet machine that is what to measure; with
a neighbour loading the cores, a block can fall into a burst of load that spares the next
one, and a candidate's noise estimate grows past its gain: bf16 measured 1.10x ± 17 % and
was dropped while a slower lever was kept, though it measured 1.47x a minute later.

So when a top candidate's noise exceeds :data:`NOISY`, or a candidate was dropped while its
median beat an accepted one, the top candidates (:data:`TOP`, by median speedup) and fp32
are timed again in a *duel*: one call each in turn, in an order that rotates every round
(fp32 A B, B fp32 A, A B fp32, ...), so that consecutive calls of different candidates
share the machine's load. Each block of :data:`BLOCK` rounds gives every candidate one
median, and blocks pair like the passes of :func:`speedflags._tune.compare.compare` (ratio
of medians taken within a second of each other). Blocks are added, at least
``Effort.duel_min_blocks``, while the order of the top two and their gain over fp32 are not
yet clear beyond the noise and the time allows (``Effort.duel_s`` of measured calls, half of
what is left under a ``seconds`` bound). The duel's timings replace the candidates' earlier
ones, so the choice is made on paired figures; :func:`confidence` then says whether it is
clear or "within noise", with both figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .._measure.rounds import measure_rounds, warm_up
from .._measure.timing import Timing
from .compare import MIN_GAIN, Effort, Z, compare, faster
from .entry import Candidate, StepRunner

__all__ = ["BLOCK", "NOISY", "TOP", "confidence", "contenders", "duel", "rotated"]

NOISY = 0.05  # a relative standard error above this is "noise that large"
TOP = 3  # candidates in a duel, besides fp32
BLOCK = 3  # rounds per block: one median per candidate and block


def contenders(entries: Sequence[Candidate]) -> list[Candidate]:
    """The candidates to duel (fastest median first), or none when the timings are clear.

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> from speedflags._tune.duel import contenders
        >>> from speedflags._tune.entry import Candidate
        >>> a, b = Candidate((("amp", "bf16"),), "lever"), Candidate((("tf32", True),), "lever")
        >>> a.timing = b.timing = Timing.of([[1.0, 1.0]])  # timed (the figures below)
        >>> a.row.speedup, a.row.noise, a.row.accepted = 1.10, 0.17, False   # noisy
        >>> b.row.speedup, b.row.noise, b.row.accepted = 1.15, 0.02, True
        >>> [e.row.label for e in contenders([a, b])]
        ['tf32=True', "amp='bf16'"]
        >>> a.row.noise = 0.02  # quiet: the timings stand
        >>> contenders([a, b])
        []
    """
    timed = [
        e for e in entries
        if e.row.speedup is not None and not e.rejected and not e.compile and e.timing
    ]  # fmt: skip
    top = sorted(timed, key=lambda e: -(e.row.speedup or 0.0))[:TOP]
    best_accepted = max((e.row.speedup or 0.0 for e in timed if e.row.accepted), default=None)
    noisy = any(e.row.noise is None or e.row.noise > NOISY for e in top)
    dropped_faster = best_accepted is not None and any(
        not e.row.accepted and (e.row.speedup or 0.0) >= best_accepted for e in top
    )
    return top if top and (noisy or dropped_faster) else []


def _resolved(fast: Timing, slow: Timing) -> bool:
    """Whether ``fast`` is faster than ``slow`` beyond the noise, or clearly within 3 %."""
    speedup, noise = compare(fast, slow)
    if not math.isfinite(speedup) or not math.isfinite(noise):
        return False
    gain, least = abs(math.log(speedup)), math.log1p(MIN_GAIN)
    return gain > max(least, Z * noise) or gain + Z * noise < least


def _clear(fp32: Timing, timings: Sequence[Timing]) -> bool:
    """The fastest two are ordered (or equal) beyond the noise, and each against fp32."""
    ranked = sorted(timings, key=lambda t: t.median)
    if not all(_resolved(t, fp32) for t in ranked[:2]):
        return False
    return len(ranked) < 2 or _resolved(ranked[0], ranked[1])


def rotated(
    clock: Callable[[], float],
    runners: Sequence[StepRunner],
    counts: Sequence[int],
    warm: bool = True,
) -> list[list[float]]:
    """Time ``counts[i]`` calls of ``runners[i]``, one call each in turn, the order rotating
    every round (A B C, B C A, ...); return each runner's times.

    With ``warm``, each runner gets one untimed call first. Calls close in time share the
    machine's load, which a block of one runner's calls after another's does not.
    """
    for runner in runners if warm else ():
        warm_up(runner, clock, 1, 0.0)
    times: list[list[float]] = [[] for _ in runners]
    for turn in range(max(counts, default=0)):
        for i in range(len(runners)):
            index = (turn + i) % len(runners)
            if len(times[index]) < counts[index]:
                times[index].extend(measure_rounds(runners[index], clock, 1))
    return times


def duel(
    fp32: Candidate,
    top: Sequence[Candidate],
    *,
    runner: Callable[[Candidate], StepRunner],
    clock: Callable[[], float],
    plan: Effort,
    left: Callable[[], float],
    say: Callable[[str], None],
) -> int:
    """Time ``fp32`` and ``top`` call by call, paired, until clear; return the blocks timed.

    ``runner(entry)`` runs an entry's step; ``clock`` times it; ``plan`` bounds the duel's
    blocks and time, ``left()`` says the run's time left, ``say`` reports progress. Sets each
    entry's ``timing`` (one pass per block), ``against`` (fp32's), and its row's speedup,
    noise, rounds and acceptance.
    """
    entries = [fp32, *top]
    runners = [runner(entry) for entry in entries]
    budget = min(plan.duel_s, 0.5 * max(left(), 0.0))
    blocks: list[list[list[float]]] = [[] for _ in entries]
    spent = 0.0
    while len(blocks[0]) < plan.duel_max_blocks:
        times = rotated(clock, runners, [BLOCK] * len(runners), warm=not blocks[0])
        for got, block in zip(blocks, times, strict=True):
            got.append(block)
            spent += sum(block)
        done = len(blocks[0])
        timings = [Timing.of(b) for b in blocks]
        if done >= plan.duel_min_blocks and (
            _clear(timings[0], timings[1:]) or spent >= budget or left() <= 0
        ):
            break
    reference = Timing.of(blocks[0])
    fp32.timing = fp32.against = reference
    for entry, got in zip(top, blocks[1:], strict=True):
        entry.timing, entry.against = Timing.of(got), reference
        speedup, noise = compare(entry.timing, reference)
        entry.row.speedup = speedup if math.isfinite(speedup) else None
        entry.row.noise = noise if math.isfinite(noise) else None
        entry.row.rounds, entry.row.median_s = entry.timing.rounds, entry.timing.median
        entry.row.accepted = faster(entry.timing, reference)
        entry.row.note = "" if entry.row.accepted else "not faster than fp32 beyond the noise"
    shown = ", ".join(f"{e.row.label} {_figure(e)}" for e in top)
    say(f"noisy timings: duel of {len(top)} beside fp32, {len(blocks[0])} blocks: {shown}")
    return len(blocks[0])


def _figure(entry: Candidate) -> str:
    speedup, noise = entry.row.speedup, entry.row.noise
    if speedup is None:
        return "-"
    spread = "?" if noise is None else f"{speedup * noise:.2f}"
    return f"{speedup:.2f}x ± {spread}"


def confidence(entries: Sequence[Candidate], best: Candidate | None) -> tuple[str, str]:
    """``("clear", "")`` or ``("within noise", why)`` for the choice ``best`` among ``entries``.

    Within noise: the runner-up (the fastest other candidate timed, whose levers neither
    contain nor are contained in the choice's) is not slower beyond the noise; or, with no
    choice, a
    candidate whose median beats fp32 by :data:`~speedflags._tune.compare.MIN_GAIN` is not
    faster beyond the noise.

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> from speedflags._tune.compare import compare
        >>> from speedflags._tune.duel import confidence
        >>> from speedflags._tune.entry import Candidate
        >>> a, b = Candidate((("amp", "bf16"),), "lever"), Candidate((("tf32", True),), "lever")
        >>> fp32 = Timing.of([[1.0], [1.2], [1.0]])
        >>> a.timing, a.against = Timing.of([[0.7], [0.9], [0.8]]), fp32
        >>> b.timing, b.against = Timing.of([[0.8], [0.8], [0.85]]), fp32
        >>> for e in (a, b):
        ...     e.row.speedup, e.row.noise, e.row.accepted = *compare(e.timing, fp32), True
        >>> confidence([a, b], a)[0]
        'within noise'
    """
    if best is None:
        close = [
            e for e in entries
            if not e.compile and not e.row.accepted and e.row.speedup is not None
            and not e.rejected and e.row.speedup > 1 + MIN_GAIN
        ]  # fmt: skip
        if not close:
            return "clear", ""
        top = max(close, key=lambda e: e.row.speedup or 0.0)
        return "within noise", f"{top.row.label} {_figure(top)} over fp32: within noise; fp32 kept"
    mine = set(best.levers)
    rivals = [
        e for e in entries
        if e is not best and e.row.speedup is not None and not e.compile and not e.rejected
        and e.timing is not None and not (set(e.levers) <= mine or mine <= set(e.levers))
    ]  # fmt: skip
    if not rivals:
        return "clear", ""
    rival = max(rivals, key=lambda e: e.row.speedup or 0.0)
    if faster(best.timing, rival.timing) or faster(rival.timing, best.timing):
        return "clear", ""
    return "within noise", (
        f"{best.row.label} and {rival.row.label} within noise: {_figure(best)} vs {_figure(rival)}"
    )
