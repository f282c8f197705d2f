"""The command line: ``python -m speedflags report|bench`` (also the ``speedflags`` script)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Tuple

from .bench import cli as bench_cli
from .errors import SpeedflagsError


def _parser() -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="speedflags",
        description="PyTorch fast-path flags: inspect them, apply the recommended ones, "
        "prove they come back, and measure what they buy.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        help="device, capabilities, both TF32 API families and every lever's state",
        description="Show the device and what it can do, PyTorch's TF32 API families, and "
        "every lever's state. --apply enters the recommended levers and shows before/after; "
        "--restore exits again and proves every getter answers as before.",
    )
    report.add_argument("--apply", action="store_true", help="enter the recommended levers")
    report.add_argument(
        "--restore", action="store_true", help="with --apply: exit again and compare every getter"
    )
    report.add_argument("--json", action="store_true", help="print JSON instead of text")
    report.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    bench = bench_cli.add_parser(sub)
    return parser, bench


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status.

    0 ok; 1 flags not restored exactly; 2 bad usage; 130 ``bench`` stopped with Ctrl-C.
    """
    parser, bench_parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.command(args, bench_parser)
    if args.command == "report":
        if args.restore and not args.apply:
            parser.error("--restore proves that --apply's changes come back; use it with --apply")
        from .report import build_report, print_report  # local: keep --help fast

        try:
            report = build_report(args.device, apply=args.apply, restore=args.restore)
        except SpeedflagsError as exc:
            print(f"speedflags: {exc}", file=sys.stderr)
            return 2
        print_report(report, args.json)
        if args.restore and not report["restore"]["exact"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
