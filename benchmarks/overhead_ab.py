"""Enter+exit overhead of two versions of speedflags, measured side by side in one run.

Each round runs ``overhead_interleaved.py`` once under each version, alternating, in fresh
processes (each version is a tree on disk: a git revision exported for the run, or this
working tree), so both see the same machine at the same time. The table gives, per version
and variant, the median over the rounds of each run's median per call, and its ratio to
plain torch measured in the same run (the ``min`` lines: the same of each run's minimum):

    .venv/bin/python benchmarks/overhead_ab.py --base 115d6cd [--base b44ed0c] [--rounds 8]

``--base`` may be given several times: every version named runs in each round.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(.+?)\s+min\s+([\d.]+) us .*median\s+([\d.]+) us")


def export(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into)  # noqa: S202 - our own repository's archive
    return into


def run_once(tree: Path, rounds: int, calls: int) -> dict[str, float]:
    """Median per call (µs) of each variant in one run of the interleaved script, and its
    minimum under the variant's name with ``" min"`` added."""
    out = subprocess.run(
        [sys.executable, "benchmarks/overhead_interleaved.py", "--rounds", str(rounds),
         "--calls", str(calls)],
        cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    medians = {}
    for line in out.splitlines():
        match = LINE.match(line)
        if match:
            medians[match.group(1).strip()] = float(match.group(3))
            medians[match.group(1).strip() + " min"] = float(match.group(2))
    return medians


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", required=True, action="append", help="a git revision to compare with (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=8, help="alternating runs of each (8)")
    parser.add_argument("--inner-rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {base: export(base, Path(tmp) / base) for base in args.base}
        trees["working tree"] = ROOT
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run_once(tree, args.inner_rounds, args.calls))
    print(f"{args.rounds} alternating runs each ({args.inner_rounds} x {args.calls} calls):")
    for name, results in runs.items():
        print(f"{name}:")
        for variant in results[0]:
            values = [r[variant] for r in results]
            base = "plain-torch min" if variant.endswith(" min") else "plain-torch"
            ratios = [r[variant] / r[base] for r in results]
            print(
                f"  {variant:12s} {statistics.median(values):6.2f} us "
                f"({statistics.median(ratios):.2f}x plain torch; runs "
                f"{min(ratios):.2f}-{max(ratios):.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
