"""``python -m speedflags verify``: did each lever take effect on this device?

Exit status: 0 every lever verified or without effect here; 1 a lever requested but not in
effect (or not measurable), or a flag not restored; 2 bad usage, refused before anything is
measured, in one line naming the option (:mod:`speedflags._cli.options`): an empty value,
an unknown device or lever, CUDA asked for where there is none, a ``--json`` file that
cannot be written; or a ``--json`` file that could not be written after all (a full disk:
the verdicts are printed first).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._measure.subcommands import add_subcommand

__all__ = ["add_parser", "command"]

DESCRIPTION = """\
Enter each lever the device supports through fast_math and measure that it took effect:
TF32 and matmul precision by the error of a float32 matmul (and conv) against float64,
autocast by the output dtype and error, cuDNN benchmark by the autotuner's trial kernels,
SDPA by the kernel that ran. Each lever gets a verdict: verified (with the figure), no effect
here (with the reason), or requested but not in effect (with the cause found, such as
NVIDIA_TF32_OVERRIDE=0). Every flag is restored afterwards.
"""


HELP = "measure that each lever really takes effect on this device"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to an ``add_subparsers()`` object."""
    parser = add_subcommand(sub, "verify", help=HELP, description=DESCRIPTION)
    parser.add_argument(
        "--levers", default=None, help="comma-separated levers to verify (default: all)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the verdicts as JSON")
    return parser


def command(args: argparse.Namespace) -> int:
    """Run ``speedflags verify`` with arguments :func:`speedflags._cli.options.check` checked
    (``lever_names`` among them; ``--json`` tried for writing); return the exit status."""
    from .._measure.output_paths import write_output
    from .._measure.verdicts import verify
    from ..errors import SpeedflagsError

    try:
        run = verify(args.device, args.lever_names)
    except SpeedflagsError as exc:
        print(f"speedflags verify: {exc}", file=sys.stderr)
        return 2
    print(run)
    if args.json:
        problem = write_output("--json", args.json, run.save)  # a full disk shows only now
        if problem is not None:
            print(f"speedflags verify: {problem}", file=sys.stderr)
            return 2
        print(f"verdicts: {args.json}")
    return 0 if run.ok else 1
