"""The enter+exit variants of ``test_overhead.py``, timed round-robin in one process.

The machine this runs on is shared and noisy, so every round times each variant once, in
turn (``--calls`` enter+exit pairs each), and the table gives each variant's minimum and
median per call over the rounds. A fourth line, ``levers only``, makes the same lever calls
the ledger makes (read, check, apply, read, restore), with no ledger
around them: what the levers themselves cost. The numbers in RESULTS.md ("enter+exit
overhead vs plain torch") come from this script:

    .venv/bin/python benchmarks/overhead_interleaved.py [--rounds 60] [--calls 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_overhead import SPEC, VARIANTS


def levers_only() -> Callable[[], None]:
    """The lever calls of one enter+exit of ``SPEC``, in plain loops, without the ledger."""
    program = SPEC._plan().program
    rows = tuple(zip(program.levers, program.values, program.checks, strict=True))
    back = rows[::-1]

    def run() -> None:
        befores = []
        for lever, _, check in rows:
            state = lever.read()
            if check:
                lever.check(state)
            befores.append(state)
        for (lever, value, _), before in zip(rows, befores, strict=True):
            lever.apply(value, before)
        for (lever, _, _), before in zip(back, reversed(befores), strict=True):
            lever.restore(before, lever.read())

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    variants: dict[str, Callable[[], None]] = dict(VARIANTS)
    variants["levers only"] = levers_only()
    for fn in variants.values():
        for _ in range(args.calls):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    clock = time.perf_counter
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start = clock()
            for _ in range(args.calls):
                fn()
            times[name].append((clock() - start) / args.calls)
    print(f"torch {torch.__version__}, {args.rounds} rounds x {args.calls} calls, per call:")
    base_min = min(times["plain-torch"])
    base_median = statistics.median(times["plain-torch"])
    for name, values in times.items():
        low, median = min(values), statistics.median(values)
        print(
            f"{name:12s} min {low * 1e6:6.2f} us ({low / base_min:.2f}x)  "
            f"median {median * 1e6:6.2f} us ({median / base_median:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
