"""The enter+exit variants of ``test_overhead.py``, timed round-robin in one process.

The machine this runs on is shared and noisy, so every round times each variant once, in
turn (``--calls`` enter+exit pairs each), and the table gives each variant's minimum and
median per call over the rounds. A fourth line, ``levers only``, makes the same lever calls
the ledger makes (read, check, apply, read, restore), with no ledger
around them: what the levers themselves cost. The numbers in RESULTS.md ("enter+exit
overhead vs plain torch") come from this script:

    .venv/bin/python benchmarks/overhead_interleaved.py [--rounds 60] [--calls 1000]

It ends with each goal (``--goals``, by default at most 1.5x plain torch, then at most 2x)
met or not by the ``fast_math`` and decorated medians; ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
    parser.add_argument(
        "--goals", default="1.5,2", help="comma-separated ratios to plain torch to check (1.5,2)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    try:
        goals = [float(g) for g in args.goals.split(",") if g]
    except ValueError:
        parser.error(f"--goals: numbers such as 1.5,2, not {args.goals!r}")
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
    figures = {}
    for name, values in times.items():
        low, median = min(values), statistics.median(values)
        figures[name] = {
            "min_s": low,
            "median_s": median,
            "min_ratio": low / base_min,
            "median_ratio": median / base_median,
        }
        print(
            f"{name:12s} min {low * 1e6:6.2f} us ({low / base_min:.2f}x)  "
            f"median {median * 1e6:6.2f} us ({median / base_median:.2f}x)"
        )
    verdicts = goal_verdicts(figures, goals)
    for line in verdicts:
        print(line)
    if args.json:
        data = {
            "format": "speedflags-overhead/1",
            "environment": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpu": platform.processor() or platform.machine(),
            },
            "settings": {"rounds": args.rounds, "calls": args.calls},
            "per_call": figures,
            "goals": goals,
            "verdicts": verdicts,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
        print(f"results: {args.json}")
    return 0


def goal_verdicts(figures: dict[str, dict[str, float]], goals: Sequence[float]) -> list[str]:
    """One line per goal: met or not by the median of ``fast_math`` and of the decorated call,
    each as a ratio to plain torch's median.

    Example:
        >>> figures = {"fast_math": {"median_ratio": 1.93}, "decorated": {"median_ratio": 1.88}}
        >>> goal_verdicts(figures, [1.5, 2])  # doctest: +NORMALIZE_WHITESPACE
        ['goal: at most 1.5x plain torch: not met (with fast_math 1.93x, decorated 1.88x)',
         'goal: at most 2x plain torch: met (with fast_math 1.93x, decorated 1.88x)']
    """
    shown = ("fast_math", "decorated")
    ratios = ", ".join(f"{name} {figures[name]['median_ratio']:.2f}x" for name in shown)
    worst = max(figures[name]["median_ratio"] for name in shown)
    return [
        f"goal: at most {goal:g}x plain torch: {'met' if worst <= goal else 'not met'} "
        f"(with {ratios})"
        for goal in goals
    ]


if __name__ == "__main__":
    sys.exit(main())
