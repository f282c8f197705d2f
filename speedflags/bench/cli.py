"""``python -m speedflags bench``: the arguments, the progress display, the exit status.

Exit status:

- 0: done.
- 1: a flag did not read as before the run afterwards.
- 2: bad usage, refused before anything is measured, in one line naming the option: an
  unknown workload or device, a count below 1, a ``--min-time`` that is negative, NaN or
  infinite, ``--threads`` above this machine's CPUs, a size whose workload would not fit in
  the device's memory, an output (``--json``, ``--plot``) in a place that cannot be written;
  or an unreadable ``--compare`` file; or an output that could not be written after all
  (the results are printed first).
- 130: stopped with Ctrl-C (the results so far are still printed and saved).

Output files: ``--json`` and ``--plot`` are checked before the run (``--plot``'s file type,
and that each file can be written); a missing folder is created, with its parents, when
the file is written, as ``tune --out`` and ``tune --plot`` do.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Optional, Tuple

from .._short_repr import short_repr

__all__ = ["add_parser", "command"]

WORKLOAD_NAMES = ("matmul", "mlp-train", "sdpa", "conv")  # checked against WORKLOADS by a test

DESCRIPTION = """\
Measure what each lever buys on this machine, with its accuracy cost beside it: for each
workload and configuration, the median time, the speedup over the fp32 baseline, FLOP/s, the
share of the fastest configuration, and the relative error against float64. Configurations
the device cannot run are skipped with the reason.

workloads (size means):
  matmul     float32 (n x n) @ (n x n); fp32, tf32, matmul precision high/medium, bf16 and
             fp16 autocast, and pure bf16/fp16 inputs (size: n)
  mlp-train  Linear(d, d) x3 train step with AdamW (the seed 002 workload), fp32 against
             fast_math(tf32=True, amp="bf16") (size: d)
  sdpa       scaled_dot_product_attention with each backend (size: sequence length)
  conv       3x3 conv2d with and without cudnn_benchmark, CUDA only (size: height = width)
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``add_subparsers()`` object."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="measure each lever's speedup and accuracy cost on this machine",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--workload",
        default=",".join(WORKLOAD_NAMES),
        help="comma-separated workloads (default: all): " + ", ".join(WORKLOAD_NAMES),
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes for every chosen workload (default: each workload's "
        "sizes for the device: matmul 1024,2048 on a CPU and 4096,8192 on a GPU); a size "
        "whose workload needs more memory than the device has (its inputs, outputs and "
        "float64 reference, estimated) is refused before the run",
    )
    parser.add_argument(
        "--passes", type=int, default=3, help="interleaved passes over the configurations (3)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds per configuration and pass, at least (5)",
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


def _ints(text: str, parser: argparse.ArgumentParser, option: str) -> Tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:  # not a number, or too many digits to convert
        parser.error(f"{option} {short_repr(text)}: expected comma-separated positive integers")
    if not values or min(values) <= 0:
        parser.error(f"{option} {short_repr(text)}: expected comma-separated positive integers")
    return values


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for option, value in (("--passes", args.passes), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{option} {value}: must be at least 1")
    # NaN passes "< 0" and infinity passes everything, then fail mid-run planning rounds
    if not math.isfinite(args.min_time) or args.min_time < 0:
        parser.error(f"--min-time {args.min_time}: must be a finite number of seconds, 0 or more")
    if args.threads is not None:
        cpus = os.cpu_count() or 1
        if not 1 <= args.threads <= cpus:
            parser.error(f"--threads {args.threads}: must be from 1 to {cpus}, the CPUs here")


def _too_big(
    workloads: Tuple[str, ...], sizes: Tuple[int, ...], device: Any, option: str
) -> Optional[str]:
    """Why a size cannot be allocated on ``device`` (its estimate against the device's
    memory), or None."""
    from .._measure.workloads import WORKLOADS, memory_bytes

    have = memory_bytes(device)
    if have is None:  # the system does not say: the run finds out
        return None
    for name in workloads:
        workload = WORKLOADS[name]
        if workload.unavailable(device):
            continue
        for size in sizes:
            need = workload.memory(size, device.type)
            if need > have:
                return (
                    f"{option} {size}: {name} at size {size} needs at least {_gib(need)} "
                    f"of memory (estimated); {device} has {_gib(have)}"
                )
    return None


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def _show(event: Any) -> None:
    """Print one progress event to stderr (finished steps, skips and group starts)."""
    if event.kind == "start":
        return
    counter = f"[{event.step:>3}/{event.steps}] " if event.kind == "done" else "        "
    print(counter + event.message, file=sys.stderr, flush=True)


def _compare(paths: Tuple[str, str]) -> int:
    from .results import BenchRun
    from .table import render_compare

    try:
        a, b = (BenchRun.load(p) for p in paths)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not a result file
        print(f"speedflags bench --compare: {exc}", file=sys.stderr)
        return 2
    print(render_compare(a, b))
    return 0


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``speedflags bench`` with parsed arguments; return the exit status."""
    if args.compare:
        return _compare(tuple(args.compare))
    bench_file = None
    if args.config:
        from .config_file import describe, load_for_cli, overlay

        bench_file, why = load_for_cli(args.config)
        if bench_file is None:
            print(f"speedflags bench: {why}", file=sys.stderr)
            return 2
        overlay(args, parser, bench_file)
        print(f"configurations from {args.config}:\n{describe(bench_file)}", file=sys.stderr)
    _check_numbers(args, parser)
    workloads = tuple(w.strip() for w in args.workload.split(",") if w.strip())
    unknown = [w for w in workloads if w not in WORKLOAD_NAMES]
    if unknown or not workloads:
        parser.error(
            f"--workload {short_repr(args.workload)}: unknown "
            f"{', '.join(map(short_repr, unknown)) or 'none'}; "
            f"valid: {', '.join(WORKLOAD_NAMES)}"
        )
    sizes: Optional[Tuple[int, ...]] = _ints(args.sizes, parser, "--sizes") if args.sizes else None

    from .._measure.plot_axes import MISSING, have_matplotlib

    if args.plot and not have_matplotlib():  # before a long run, not after it
        print(f"speedflags bench: {MISSING}", file=sys.stderr)
        return 2
    problem = _check_outputs(args)
    if problem is not None:
        print(f"speedflags bench: {problem}", file=sys.stderr)
        return 2

    import torch

    from ..errors import SpeedflagsError
    from ..hardware import missing_cuda, resolve_device
    from .runner import Settings, run
    from .table import render

    try:
        device = resolve_device(args.device, "bench")
    except SpeedflagsError as exc:
        print(f"speedflags bench: {exc}", file=sys.stderr)
        return 2
    missing = missing_cuda(device)
    if missing is not None:
        print(f"speedflags bench: --device {device}: {missing}", file=sys.stderr)
        return 2
    too_big = _too_big(workloads, sizes, device, "--sizes") if sizes else None
    if too_big is not None:
        print(f"speedflags bench: {too_big}", file=sys.stderr)
        return 2
    settings = Settings(
        device,
        workloads,
        sizes,
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
        result = run(settings, _show)
    finally:
        torch.set_num_threads(threads)
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


def _check_outputs(args: argparse.Namespace) -> Optional[str]:
    """Why ``--json`` or ``--plot`` could not be written after the run, or None."""
    from .._measure.output_paths import check_output
    from .._measure.plot_axes import PLOT_SUFFIXES
    from ..errors import SpeedflagsError

    try:
        if args.json:
            check_output(args.json, "--json")
        if args.plot:
            check_output(args.plot, "--plot", PLOT_SUFFIXES)
    except SpeedflagsError as exc:
        return str(exc)
    return None


def _write_outputs(args: argparse.Namespace, result: Any) -> bool:
    """Save and plot as asked; False (said on stderr) if a file could not be written after
    all (both were checked before the run)."""
    try:
        if args.json:
            result.save(args.json)
            print(f"results: {args.json}")
        if args.plot:
            from .plot import plot

            points = plot(result, args.plot)
            print(f"plot: {args.plot} ({points} points)")
    except OSError as exc:
        print(f"speedflags bench: could not write an output: {exc}", file=sys.stderr)
        return False
    return True
