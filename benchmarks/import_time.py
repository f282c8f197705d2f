"""What ``import speedflags`` costs after ``import torch``: seconds, and speedflags' modules.

Each round imports torch, then speedflags, in a fresh interpreter per version, alternating
between the versions (each a git revision exported for the run, and this working tree), so
every version sees the same machine at the same time. Prints, per version, the median, the
lowest and the highest time over the rounds, and the number of speedflags modules loaded;
then the same with the garbage collector off during the import. A full collection often
falls inside the import (torch's import leaves the oldest generation near its threshold):
60 to 145 ms with PyTorch 2.1.2 on Python 3.10 on a 2-vCPU AMD EPYC (more when the machine
is loaded), none with PyTorch 2.13 on Python 3.11. It would run a moment later anyway; the
second figure is speedflags' own work.

    .venv/bin/python benchmarks/import_time.py [--base f53b287] [--rounds 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURE = """
import gc, json, sys, time
import torch
if GC_OFF:
    gc.disable()
start = time.perf_counter()
import speedflags
took = time.perf_counter() - start
loaded = sum(m.split(".")[0] == "speedflags" for m in sys.modules)
print(json.dumps([took, loaded, torch.__version__]))
"""


def export(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into)  # noqa: S202 - our own repository's archive
    return into


def import_once(tree: Path, gc_off: bool = False) -> tuple[float, int, str]:
    """Seconds ``import speedflags`` took after torch, and the speedflags modules loaded."""
    out = subprocess.run(
        [sys.executable, "-c", f"GC_OFF = {gc_off}\n{MEASURE}"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    took, modules, torch_version = json.loads(out.strip().splitlines()[-1])
    return float(took), int(modules), str(torch_version)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="append", default=[], help="a git revision (repeatable)")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        for revision in args.base:
            trees[revision] = export(revision, Path(tmp) / revision)
        times: dict[tuple[str, bool], list[float]] = {}
        modules: dict[str, int] = {}
        for tree in trees.values():  # a first import fills the .pyc caches: not timed
            torch_version = import_once(tree)[2]
        for _ in range(args.rounds):
            for gc_off in (False, True):
                for name, tree in trees.items():
                    took, modules[name], _ = import_once(tree, gc_off)
                    times.setdefault((name, gc_off), []).append(took)
    python = sys.version.split()[0]
    print(
        f"import speedflags after import torch, {args.rounds} rounds, Python {python}, "
        f"PyTorch {torch_version}"
    )
    for (name, gc_off), seen in times.items():
        print(
            f"{name:>12}{' (gc off)' if gc_off else '         '}: median "
            f"{statistics.median(seen) * 1e3:6.1f} ms (min {min(seen) * 1e3:.1f}, "
            f"max {max(seen) * 1e3:.1f}), {modules[name]} speedflags modules"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
