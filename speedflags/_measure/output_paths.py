"""The command line's output files: checked before a run, their folders made when written.

``bench --json/--plot`` and ``tune --out/--plot`` write their files after a run that can
take minutes. :func:`check_output` refuses, before anything is measured, a path that could
not be written then: a wrong file type, a folder, a path through a regular file, a folder
that refuses new files (read-only, ``/proc``). It tries for real instead of trusting
permission bits (which ``root`` ignores and ``/proc`` does not honour): it creates and
removes a temporary file in the folder, or opens an existing file for appending without
writing to it.

A missing folder is the same in both commands: it is created, with its parents, when the
file is written (:func:`make_parent_folder`); the check only makes sure that it can be, by
trying its nearest existing folder.

Example:
    >>> import os, tempfile
    >>> from speedflags._measure.output_paths import check_output
    >>> folder = tempfile.mkdtemp()
    >>> check_output(os.path.join(folder, "new", "results.json"), "--json", (".json",))
    >>> try:
    ...     check_output(folder, "--json", (".json",))
    ... except ValueError as exc:  # InvalidValueError
    ...     print(str(exc).split(": ", 1)[1])  # doctest: +ELLIPSIS
    a folder, not a file; give a file path in it, such as '...x.json'
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional, Sequence, Union

from .._short_repr import short_repr
from ..errors import InvalidValueError

__all__ = ["check_output", "make_parent_folder"]

PathArg = Union[str, "os.PathLike[str]"]


def check_output(path: PathArg, option: str, suffixes: Optional[Sequence[str]] = None) -> None:
    """Refuse ``path`` now if writing it after the run would fail.

    Args:
        path: the file to be written.
        option: how the user gave it (``"--json"``), for the message.
        suffixes: the file types accepted (``(".json", ".toml")``), or ``None`` for any.

    Raises:
        InvalidValueError: ``"--json '/proc/x.json': cannot create files in '/proc': ..."``:
            the option, the path (at most ~200 characters of it) and what is wrong.
    """
    given = os.fspath(path)
    shown = f"{option} {short_repr(given)}"
    if "\0" in given:  # os.path answers False for it; open() would raise ValueError
        raise InvalidValueError(f"{shown}: a path cannot hold a NUL character")
    if os.path.isdir(given):
        example = os.path.join(given, "x" + suffixes[0]) if suffixes else None
        raise InvalidValueError(
            f"{shown}: a folder, not a file; give a file path in it"
            + (f", such as {short_repr(example)}" if example else "")
        )
    _check(os.path.abspath(given), shown, suffixes)


def _check(full: str, shown: str, suffixes: Optional[Sequence[str]]) -> None:
    suffix = os.path.splitext(full)[1].lower()
    if suffixes is not None and suffix not in suffixes:
        raise InvalidValueError(
            f"{shown}: unknown file type {short_repr(suffix or '(none)')}; "
            f"valid: {', '.join(suffixes)}"
        )
    if os.path.lexists(full):  # it will be overwritten: may it be?
        try:
            fd = os.open(full, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise InvalidValueError(f"{shown}: cannot be written: {_why(exc)}") from None
        os.close(fd)
        return
    folder = os.path.dirname(full)
    existing = folder
    while not os.path.lexists(existing):  # the nearest existing folder (the root exists)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidValueError(
            f"{shown}: {short_repr(existing)} is a file, so no folder can be made under it"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".speedflags-write-check-", dir=existing)
    except OSError as exc:
        raise InvalidValueError(
            f"{shown}: cannot create files in {short_repr(existing)}: {_why(exc)}"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def make_parent_folder(path: PathArg) -> None:
    """Create the folder ``path`` goes in, with its parents, if it is missing."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
