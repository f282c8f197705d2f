"""The train-step variants of ``test_train_step.py``, timed round-robin in one process.

pytest-benchmark times one variant after another, so a neighbour that wakes up during one
of them moves the ratio. Here every round runs each variant once, in turn, and the medians
come from the same stretch of time. The numbers in RESULTS.md ("Small transformer train
step") come from this script:

    .venv/bin/python benchmarks/train_step_interleaved.py [--rounds 25] [--threads N]

``--device cuda`` times the same steps on a GPU (``make gpu-check`` does), each step
synchronised before its clock stops, and adds the CUDA Graphs variants
(``compile={"mode": "reduce-overhead"}`` and ``cuda_graphs=True``; skipped on a CPU,
saying why). Before timing,
each variant trains its own copy of one initialisation for five steps (``--check-steps``)
on the same batches, its warm-up (compiling and recording) included: its losses are
compared with fp32 eager's, and its parameters must have moved. For the CUDA Graphs
variant one more step runs under the profiler, which counts the graph launches (a step
that replays none measures no CUDA Graphs), and inductor's count of graphs it would not
record is read. ``--json PATH`` writes all of it, with every variant's median, quartiles
and speedup against fp32 eager. Exit 1 when a variant's losses are off, its parameters did
not move, its compile fell back to eager, or the CUDA Graphs variant replayed no graph.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_step import CHECK_STEPS, CUDA_ONLY, VARIANTS, _batches, _make

FORMAT = "speedflags-train-step/1"
WARMUP_STEPS = CHECK_STEPS  # the compiled variants compile (and record) in their first steps
LOSS_TOLERANCE = 3e-2  # bf16 keeps 8 mantissa bits (the pytest twin's bound)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _graph_launches(step: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> int:
    """CUDA graph launches in one call of ``step`` (the profiler's ``cudaGraphLaunch``)."""
    from speedflags._measure.evidence import cuda_trace

    _, trace = cuda_trace(lambda: step(x, y), x.device)
    return sum(1 for op in trace.ops if "cudaGraphLaunch" in op)


def _cudagraph_skips() -> int:
    """How many graphs inductor has declined to record as CUDA Graphs in this process."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"].get("cudagraph_skips", 0))


def main(argv: Sequence[str] | None = None) -> int:
    """Check, time and report every variant; 0 when each passed its checks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, the first the baseline (default: {','.join(VARIANTS)})",
    )
    parser.add_argument(
        "--check-steps",
        type=int,
        default=WARMUP_STEPS,
        help=f"steps each variant trains, compared and untimed, before timing ({WARMUP_STEPS}; "
        "at least 3 for the CUDA Graphs variant: a warm-up, a recording, a replay)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.check_steps < 1:
        parser.error("--rounds and --check-steps must be at least 1")
    cuda = args.device == "cuda"
    if cuda and args.check_steps < 3 and any(v in CUDA_ONLY for v in chosen):
        parser.error("--check-steps: at least 3 where CUDA Graphs run")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    skipped = {v: CUDA_ONLY[v] for v in chosen if v in CUDA_ONLY and not cuda}
    runs = [v for v in chosen if v not in skipped]
    batches = _batches(args.device)
    made = {variant: _make(args.device, variant) for variant in runs}
    records: dict[str, dict[str, Any]] = {v: {"variant": v} for v in chosen}
    for variant, reason in skipped.items():
        records[variant]["skipped"] = reason
    problems: list[str] = []
    reference: list[float] | None = None
    for variant, (step, model) in made.items():
        record = records[variant]
        start = _flat(model)
        skips_before = _cudagraph_skips()
        losses = [float(step(x, y)) for x, y in batches[: args.check_steps]]  # read at once
        sync()
        moved = float((_flat(model) - start).norm())
        record["losses"] = losses
        record["parameters_moved"] = moved
        if reference is None:
            reference = losses
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        record["loss_rel_err_vs_baseline"] = rel
        if not rel < LOSS_TOLERANCE:  # NaN fails too
            problems.append(f"{variant}: losses differ from {runs[0]}'s by {rel:.2e}")
        if not moved > 0:
            problems.append(f"{variant}: the parameters did not move in {len(losses)} steps")
        stats = getattr(step, "stats", None)
        if stats is not None:
            record["mode"] = stats.mode
            graphs = getattr(stats, "cuda_graphs", None)
            if graphs is not None:  # @speedup(cuda_graphs=True): what its graphs did
                record["cuda_graphs"] = graphs.to_dict()
            if stats.mode == "fallback":
                reason = getattr(stats, "fallback_reason", "")
                problems.append(f"{variant}: the compile fell back to eager: {reason}")
        if "graphs" in variant:
            record["cudagraph_skips"] = _cudagraph_skips() - skips_before
            x, y = batches[args.check_steps % len(batches)]
            launches = _graph_launches(step, x, y)
            record["graph_launches_per_step"] = launches
            if launches == 0:
                problems.append(
                    f"{variant}: no CUDA graph replayed in a step after warm-up "
                    f"(inductor declined {record['cudagraph_skips']} graph(s))"
                )
    sync()
    times: dict[str, list[float]] = {variant: [] for variant in made}
    pool = itertools.cycle(batches)
    for _ in range(args.rounds):
        for variant, (step, _model) in made.items():
            x, y = next(pool)
            start_s = time.perf_counter()
            step(x, y)
            sync()
            times[variant].append(time.perf_counter() - start_s)
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, {args.rounds} rounds")
    baseline = statistics.median(times[runs[0]])
    for variant in chosen:
        record = records[variant]
        if variant in skipped:
            print(f"{variant:22s} skipped: {skipped[variant]}")
            continue
        median = statistics.median(times[variant])
        low, _, high = (
            statistics.quantiles(times[variant], n=4) if args.rounds > 1 else [median] * 3
        )
        record.update(median_s=median, iqr_s=[low, high], speedup_vs_baseline=baseline / median)
        extra = ""
        if "graph_launches_per_step" in record:
            extra = f"  graph launches/step {record['graph_launches_per_step']}"
        print(
            f"{variant:22s} median {median * 1e3:7.1f} ms  "
            f"IQR {low * 1e3:.1f}-{high * 1e3:.1f} ms  speedup {baseline / median:.2f}x{extra}"
        )
    for problem in problems:
        print(f"WRONG: {problem}")
    if args.json:
        data = {
            "format": FORMAT,
            "environment": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": args.device,
                "device_name": where,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "settings": {
                "rounds": args.rounds,
                "check_steps": args.check_steps,
                "baseline": runs[0],
            },
            "variants": [records[v] for v in chosen],
            "problems": problems,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
        print(f"results: {args.json}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
