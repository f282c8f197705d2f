"""``python -m speedflags bench``: the arguments, the progress display, the exit status.

Exit status:

- 0: done.
- 1: a flag did not read as before the run afterwards.
- 2: bad usage, refused before anything is measured, in one line naming the option
  (:mod:`speedflags._cli.options` checks them all): an empty value, an unknown workload or
  device, ``--passes`` outside 1-100 or ``--rounds`` outside 1-1000, a ``--min-time`` that
  is negative, NaN or infinite, ``--threads`` above this machine's CPUs, sizes that no
  chosen workload fits in the device's memory (one that some do not fit skips those, each
  with its reason, and runs the rest), an output (``--json``, ``--plot``) in a
  place that cannot be written; a process whose TF32 state is mixed; an unreadable
  ``--compare`` file; or an output that could not be written after all (a full disk: the
  results are printed first).
- 130: stopped with Ctrl-C (the results so far are still printed and saved).

Output files: ``--json`` and ``--plot`` are checked before the run (``--plot``'s file type,
and that each file can be written); a missing folder is created, with its parents, when
the file is written, as ``tune --out`` and ``tune --plot`` do.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._measure.subcommands import add_subcommand
from .._short_repr import short_repr

__all__ = ["add_parser", "command"]

# checked against WORKLOADS by a test
WORKLOAD_NAMES = (
    "matmul", "mlp-train", "sdpa", "conv", "linear-infer", "convnet-train", "transformer-train"
)  # fmt: skip

DESCRIPTION = """\
Measure what each lever buys on this machine, with its accuracy cost beside it: for each
workload and configuration, the median time, the speedup over the fp32 baseline, FLOP/s, the
share of the fastest configuration, and the relative error against float64. Configurations
are timed in interleaved passes, each warmed up; a speedup within the noise of its passes is
marked ~ and given below the table with its spread. Configurations with no effect on the
device, refused by this PyTorch, identical to the baseline, or doing on the device what
another does (tf32+amp-bf16 on a CPU, where TF32 does nothing, is amp-bf16) are skipped with
the reason; emulated ones (bf16 or fp16 on a CPU without the instructions) are measured once,
at a small size, in a group marked (emulated). A workload that a size does not fit in the
device's memory (estimated) is skipped at that size. Before it starts, the run says about
how long it will take, from float32 matmuls timed on the device just then.

workloads (size means):
  matmul     float32 (n x n) @ (n x n); fp32, tf32, matmul precision high/medium, bf16 and
             fp16 autocast, and pure bf16/fp16 inputs (size: n)
  mlp-train  3xLinear(d, d) AdamW train step (GELU, batch min(512, d)): fp32 against
             bf16 autocast with and without TF32, and param_dtype="bf16", each entered
             around every step as @speedup does (size: d)
  sdpa       scaled_dot_product_attention with each backend (size: sequence length)
  conv       3x3 conv2d with and without cudnn_benchmark, CUDA only (size: height = width)
  linear-infer   Linear(d, d) x4 inference at batch 4 (weight-bound): fp32, autocast around
             each forward, param_dtype="bf16" held around the loop, pure bf16 (size: d)
  convnet-train  a small conv net's train step: fp32, memory_format="channels_last", with
             and without autocast around each step (size: height = width)
  transformer-train  a small transformer's train step (launch-bound on a fast GPU): fp32
             eager, bf16 autocast, @speedup compiled, @speedup(cuda_graphs=True), the last
             CUDA only (size: sequence length)
"""


HELP = "measure each lever's speedup and accuracy cost on this machine"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``add_subparsers()`` object."""
    parser = add_subcommand(sub, "bench", help=HELP, description=DESCRIPTION)
    parser.add_argument(
        "--workload",
        default=",".join(WORKLOAD_NAMES),
        help="comma-separated workloads (default: all): " + ", ".join(WORKLOAD_NAMES),
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes for every chosen workload (default: each workload's "
        "sizes for the device: matmul 1024,2048 on a CPU and 4096,8192 on a GPU); a workload "
        "that needs more memory at a size than the device has (its inputs, outputs and "
        "float64 reference, estimated) is skipped there, with its reason; sizes that no "
        "chosen workload fits are refused before the run",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="interleaved passes over the configurations, 1 to 100 (3)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds per configuration and pass, at least; 1 to 1000 (5)",
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=0.25,
        help="timed seconds per configuration and pass, at least (0.25): a finite number, "
        "0 or more (rounds stay within 1000)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the run (torch.set_num_threads), at most the CPUs here",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="configurations, workloads, sizes and settings from a YAML, TOML or JSON file, or "
        "a lever file from tune (see speedflags.bench.config_file); options given here win",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the results and their provenance; checked before the run, a missing "
        "folder is created",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a plot of speedup against error (.png, .svg, .pdf; needs matplotlib); "
        "checked before the run, a missing folder is created",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="show two result files side by side instead of measuring",
    )
    return parser


def _show(event: Any) -> None:
    """Print one progress event to stderr (finished steps, skips and group starts)."""
    if event.kind == "start":
        return
    counter = f"[{event.step:>3}/{event.steps}] " if event.kind == "done" else "        "
    print(counter + event.message, file=sys.stderr, flush=True)


def _say_how_long(settings: Any) -> float:
    """Say, before the run, how long it should take (:mod:`speedflags.bench.estimate`), and
    return the estimate in seconds."""
    from .estimate import calibrate, duration

    model = calibrate(settings.device)
    expected = float(settings.estimated_s(model))
    print(
        f"speedflags bench: about {duration(expected)} (estimated from float32 matmuls here "
        f"now: {model}; {settings.passes} interleaved passes; Ctrl-C stops it and prints "
        "what was measured)",
        file=sys.stderr,
        flush=True,
    )
    return expected


def _compare(paths: tuple[str, str]) -> int:
    from .results import BenchRun
    from .table import render_compare

    runs = []
    for path in paths:  # in order: the first file that cannot be read is the one named
        try:
            runs.append(BenchRun.load(path))
        except OSError as exc:
            why = "no such file" if isinstance(exc, FileNotFoundError) else exc.strerror
            print(f"speedflags bench: --compare {short_repr(path)}: {why}", file=sys.stderr)
            return 2
        except ValueError as exc:  # not JSON, or not a result file: the message names the file
            print(f"speedflags bench --compare: {exc}", file=sys.stderr)
            return 2
    a, b = runs
    print(render_compare(a, b))
    return 0


def command(args: argparse.Namespace) -> int:
    """Run ``speedflags bench`` with arguments :func:`speedflags._cli.options.check` checked
    (``workloads``, ``size_list``, ``resolved_device`` and ``bench_file`` among them);
    return the exit status."""
    if args.compare:
        return _compare(tuple(args.compare))
    bench_file = args.bench_file
    if bench_file is not None:
        from .config_file import describe

        print(f"configurations from {args.config}:\n{describe(bench_file)}", file=sys.stderr)

    import torch

    from .estimate import duration
    from .runner import Settings, run
    from .table import render

    settings = Settings(
        args.resolved_device,
        args.workloads,
        args.size_list,
        passes=args.passes,
        min_rounds=args.rounds,
        min_time_s=args.min_time,
    )
    if bench_file is not None:
        from .config_file import settings_with

        settings = settings_with(settings, bench_file)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        expected = _say_how_long(settings)
        result = run(settings, _show)
    finally:
        torch.set_num_threads(threads)
    took = result.environment.get("elapsed_s")
    if took is not None:
        # an interrupted run did not take the estimate's time: say when it stopped instead
        done = "stopped after" if result.interrupted else "took"
        print(f"{done} {duration(took)} (estimated: {duration(expected)})", file=sys.stderr)
    if result.interrupted:
        print("\ninterrupted (Ctrl-C): the results so far", flush=True)
    print(render(result.results))
    if result.flags_restored:
        print("\nflags: every lever reads as it did before the run")
    else:
        print("\nflags: NOT restored: some lever reads differently than before the run")
    if not _write_outputs(args, result):
        return 2
    if result.interrupted:
        return 130
    return 0 if result.flags_restored else 1


def _write_outputs(args: argparse.Namespace, result: Any) -> bool:
    """Save and plot as asked; False (said on stderr, one line per file) if a file could
    not be written after all (both were checked before the run: a full disk shows only
    now)."""
    from .._measure.output_paths import write_output

    problems = []
    if args.json:
        problem = write_output("--json", args.json, result.save)
        problems.append(problem)
        if problem is None:
            print(f"results: {args.json}")
    if args.plot:
        from .plot import plot

        points: list[int] = []
        problem = write_output("--plot", args.plot, lambda path: points.append(plot(result, path)))
        problems.append(problem)
        if problem is None:
            print(f"plot: {args.plot} ({points[0]} points)")
    for problem in problems:
        if problem is not None:
            print(f"speedflags bench: {problem}", file=sys.stderr)
    return not any(problems)
