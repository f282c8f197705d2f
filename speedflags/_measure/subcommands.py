"""What the subcommands share: ``bench``'s and ``verify``'s parser, made the same way, and
the error every command line's checks raise (:class:`UsageError`).

Both are ``python -m speedflags`` subcommands whose description is a preformatted text and
whose first option is ``--device``; each adds its own options after it.

Example:
    >>> import argparse
    >>> from speedflags._measure.subcommands import add_subcommand
    >>> sub = argparse.ArgumentParser(prog="speedflags").add_subparsers()
    >>> parser = add_subcommand(sub, "verify", help="...", description="Measure.")
    >>> parser.parse_args(["--device", "cpu"]).device
    'cpu'
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DEVICE_HELP", "UsageError", "add_subcommand"]

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda if available)"


class UsageError(Exception):
    """A bad command line (an option, a target file): one line naming it, exit status 2.
    ``python -m speedflags`` says it as ``speedflags <command>: ...``."""


def add_subcommand(sub: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """``name``'s parser in ``sub`` (an ``add_subparsers()`` object), its description kept
    as written, with the ``--device`` option."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    return parser
