"""The train-step variants of ``test_train_step.py``, timed round-robin in one process.

pytest-benchmark times one variant after another, so a neighbour that wakes up during one
of them moves the ratio. Here every round runs each variant once, in turn, and the medians
come from the same stretch of time. The numbers in RESULTS.md ("Small transformer train
step") come from this script:

    .venv/bin/python benchmarks/train_step_interleaved.py [--rounds 25] [--threads N]

``--device cuda`` times the same steps on a GPU (``make gpu-check`` does), each step
synchronised before its clock stops.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_step import VARIANTS, _batches, _make_step

WARMUP_STEPS = 5  # the compiled variant compiles in its first step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    batches = _batches(args.device)
    steps = {variant: _make_step(args.device, variant) for variant in VARIANTS}
    for step in steps.values():
        for x, y in batches[:WARMUP_STEPS]:
            step(x, y)
    sync()
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    pool = itertools.cycle(batches)
    for _ in range(args.rounds):
        for variant, step in steps.items():
            x, y = next(pool)
            start = time.perf_counter()
            step(x, y)
            sync()
            times[variant].append(time.perf_counter() - start)
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, {args.rounds} rounds")
    baseline = statistics.median(times[VARIANTS[0]])
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        low, _, high = statistics.quantiles(times[variant], n=4)
        print(
            f"{variant:22s} median {median * 1e3:7.1f} ms  "
            f"IQR {low * 1e3:.1f}-{high * 1e3:.1f} ms  speedup {baseline / median:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
