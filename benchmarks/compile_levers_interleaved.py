"""The variants of ``test_compile_levers.py``, timed round-robin in one process.

pytest-benchmark times one variant after another, so a neighbour that wakes up during one
of them moves the ratio; the 5% goal (an amp block inside a compiled step against
``torch.autocast`` inside it) needs the variants timed over the same stretch of time. Every
round runs each variant once, in turn. The numbers in RESULTS.md ("torch.compile and the
levers") come from this script:

    .venv/bin/python benchmarks/compile_levers_interleaved.py [--rounds 200] [--threads 1]
        [--backends aot_eager,inductor] [--variants torch.autocast-outside,speedup-outside]

It prints, per backend, each amp variant's median train step, its ratio to
``torch.autocast`` and the dtype it computed in (a block that did not become an autocast
region shows float32); then the per-call cost of the guard on a step that does almost
nothing (``torch.compile`` against ``guard_levers`` and ``@speedup``), and of
``lever_state()`` alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_compile_levers import (
    AMP_VARIANTS,
    BATCH,
    GUARD_VARIANTS,
    WIDTH,
    _amp_step,
    _model,
    _train,
)

from speedflags._compile.lever_state import lever_state

VARIANTS = ["torch.autocast", *[v for v in AMP_VARIANTS if v != "torch.autocast"]]
WARMUP = 3


def _interleave(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def _amp(backend: str, rounds: int, variants: Sequence[str]) -> None:
    runs: dict[str, Callable[[], Any]] = {}
    dtypes: dict[str, str] = {}
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    for variant in variants:
        model = _model()
        step = _amp_step(variant, model, backend)
        try:
            for _ in range(WARMUP):
                dtype = _train(step, model, x)
        except Exception as exc:  # reported; the other variants still run
            print(f"  {variant:22s} does not compile: {type(exc).__name__}")
            continue
        dtypes[variant] = str(dtype).replace("torch.", "")
        runs[variant] = lambda s=step, m=model: _train(s, m, x)
    times = _interleave(runs, rounds)
    base = statistics.median(times["torch.autocast"])
    for variant, samples in times.items():
        median = statistics.median(samples)
        print(
            f"  {variant:22s} median {median * 1e3:8.3f} ms  "
            f"x{median / base:6.3f} of torch.autocast  ({dtypes[variant]})"
        )


def _guard(rounds: int, calls: int = 200) -> None:
    x = torch.ones(4)
    fns = {name: make() for name, make in GUARD_VARIANTS.items()}
    for fn in fns.values():
        fn(x)
    runs: dict[str, Callable[[], Any]] = {
        name: (lambda f=fn: [f(x) for _ in range(calls)]) for name, fn in fns.items()
    }
    runs["lever_state"] = lambda: [lever_state() for _ in range(calls)]
    times = _interleave(runs, rounds)
    base = statistics.median(times["torch.compile"]) / calls
    for name, samples in times.items():
        per_call = statistics.median(samples) / calls
        extra = "" if name == "lever_state" else f"  (+{(per_call - base) * 1e6:5.2f} µs)"
        print(f"  {name:22s} {per_call * 1e6:7.2f} µs per call{extra}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="amp variants, comma-separated (torch.autocast is always timed: the baseline)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # the variants' warnings are the benchmark's extra_info
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        print(f"amp inside a compiled train step, backend {backend}:")
        chosen = [v for v in args.variants.split(",") if v != "torch.autocast"]
        _amp(backend, args.rounds, ["torch.autocast", *chosen])
    torch._dynamo.reset()
    print("guard per call (backend eager, a step that adds 1 to 4 numbers):")
    _guard(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
