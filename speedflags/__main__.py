"""The command line: ``python -m speedflags report|bench|tune|verify`` (also ``speedflags``).

Under ``torchrun`` (``torchrun --nproc_per_node=N -m speedflags report``) each rank joins a
gloo process group set up from torchrun's environment, the ranks' states are gathered, and
rank 0 prints each rank's state and the verdict. Every rank exits with status 1 when the
ranks disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

from ._cli import options
from ._tune import cli as tune_cli
from ._verify import cli as verify_cli
from .bench import cli as bench_cli
from .errors import SpeedflagsError

# torchrun (torch.distributed.run) sets these for every worker
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
GROUP_TIMEOUT_S = 120


def launched_by_torchrun() -> bool:
    """True in a worker that torchrun started as one of several ranks."""
    return all(name in os.environ for name in TORCHRUN_ENV) and os.environ["WORLD_SIZE"] != "1"


@contextlib.contextmanager
def torchrun_group() -> Iterator[None]:
    """Join the job's process group from torchrun's environment, for the report's gather.

    gloo: it gathers a few kilobytes, and works on CPU-only and GPU machines alike. Nothing
    is done when torchrun did not start this process or a group already exists (the caller's
    group is used and left as it is).
    """
    import torch.distributed as dist

    if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
        yield
        return
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        yield
        dist.barrier()  # every rank is done with the group before any leaves it
    finally:
        dist.destroy_process_group()


def _default_device(requested: str | None) -> str | None:
    # under torchrun each rank reports on its own GPU
    if requested is None and launched_by_torchrun():
        import torch

        if torch.cuda.is_available():  # ranks share the GPUs when there are more of them
            return f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    return requested


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = options.Parser(
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
    commands = {
        "report": report,
        "bench": bench_cli.add_parser(sub),
        "tune": tune_cli.add_parser(sub),
        "verify": verify_cli.add_parser(sub),
    }
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    0: ok; 1: ``--restore`` was not exact, the ranks of a distributed job disagree, a flag
    did not read as before a ``bench`` run, or ``verify`` found a lever not in effect; 2: bad
    usage (one line naming the option, before anything is measured or a user's file is
    imported: :mod:`speedflags._cli.options`), or an output file that could not be written
    after all (a full disk); 3: the step ``tune``
    measures raised (its traceback is shown); 130: ``bench`` or ``tune`` stopped with Ctrl-C.
    """
    parser, commands = _parser()
    try:  # a bad option is one line (options.Parser); --help exits 0
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:  # every option, before a user's file is imported or anything is measured
        options.check(args, commands[args.command])
    except options.UsageError as exc:
        print(f"speedflags {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "bench":
        return bench_cli.command(args)
    if args.command == "tune":
        return tune_cli.command(args)
    if args.command == "verify":
        return verify_cli.command(args)
    if args.command == "report":
        from .report import build_report, print_report  # local: keep --help fast

        try:
            with torchrun_group():
                report = build_report(
                    _default_device(args.device), apply=args.apply, restore=args.restore
                )
        except SpeedflagsError as exc:
            print(f"speedflags: {exc}", file=sys.stderr)
            return 2
        ranks = report.get("ranks")
        if ranks is None or ranks["rank"] == 0:  # one report per job, from rank 0
            print_report(report, args.json)
        if args.restore and not report["restore"]["exact"]:
            return 1
        if ranks is not None and not ranks["consistent"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
