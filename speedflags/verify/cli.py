"""``python -m speedflags verify``: did each lever take effect on this device?

Exit status: 0 every lever verified or without effect here; 1 a lever requested but not in
effect (or not measurable), or a flag not restored; 2 bad usage (an unknown device or
lever, CUDA asked for where there is none, an output file that cannot be written).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List, Optional

__all__ = ["add_parser", "command"]

DESCRIPTION = """\
Enter each lever the device supports through fast_math and measure that it took effect:
TF32 and matmul precision by the error of a float32 matmul (and conv) against float64,
autocast by the output dtype and error, cuDNN benchmark by the autotuner's trial kernels,
SDPA by the kernel that ran. Each lever gets a verdict: verified (with the figure), no effect
here (with the reason), or requested but not in effect (with the cause found, such as
NVIDIA_TF32_OVERRIDE=0). Every flag is restored afterwards.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to an ``add_subparsers()`` object."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "verify",
        help="measure that each lever really takes effect on this device",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--levers", default=None, help="comma-separated levers to verify (default: all)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the verdicts as JSON")
    return parser


def _writable(path: str) -> Optional[str]:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--json {path!r}: is a folder"
    probe = folder
    while not os.path.exists(probe):  # the folder is created when the file is written
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        return f"--json {path!r}: {probe} is not writable"
    return None


def command(args: argparse.Namespace) -> int:
    """Run ``speedflags verify`` with parsed arguments; return the exit status."""
    from .._measure.verdicts import verify
    from ..errors import SpeedflagsError

    if args.json:
        problem = _writable(args.json)
        if problem:  # before the measurements, not after them
            print(f"speedflags verify: {problem}", file=sys.stderr)
            return 2
    levers: Optional[List[str]] = None
    if args.levers is not None:
        levers = [name.strip() for name in args.levers.split(",") if name.strip()]
    try:
        run = verify(args.device, levers)
    except SpeedflagsError as exc:
        print(f"speedflags verify: {exc}", file=sys.stderr)
        return 2
    print(run)
    if args.json:
        run.save(args.json)
        print(f"verdicts: {args.json}")
    return 0 if run.ok else 1
