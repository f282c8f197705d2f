"""The command line's output files: checked before a run, their folders made when written.

``bench --json/--plot`` and ``tune --out/--plot`` write their files after a run that can
take minutes. :func:`check_output` refuses, before anything is measured, a path that could
not be written then: a wrong file type, a folder, a path through a regular file, a folder
that refuses new files (read-only, ``/proc``), a name the file system refuses. It tries
for real instead of trusting permission bits (which ``root`` ignores and ``/proc`` does
not honour; ``os.access`` answers for the real user, not the effective one): it opens an
existing file for appending without writing to it, or creates the file (and the folders
it needs) and removes what it made.

A missing folder is the same in every command: it is created, with its parents, when the
file is written (:func:`make_parent_folder`). A place that refuses only when written
(``/dev/full``: a full disk) is found then: :func:`write_output` says so in one line.

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
from collections.abc import Callable, Sequence
from typing import Any, Union

from .._short_repr import short_repr
from ..errors import InvalidValueError

__all__ = ["check_output", "make_parent_folder", "write_output"]

PathArg = Union[str, "os.PathLike[str]"]


def check_output(path: PathArg, option: str, suffixes: Sequence[str] | None = None) -> None:
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


def _check(full: str, shown: str, suffixes: Sequence[str] | None) -> None:
    suffix = os.path.splitext(full)[1].lower()
    if suffixes is not None and suffix not in suffixes:
        raise InvalidValueError(
            f"{shown}: unknown file type {short_repr(suffix or '(none)')}; "
            f"valid: {', '.join(suffixes)}"
        )
    if os.path.exists(full):  # it will be overwritten: may it be? (opened, not truncated)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise InvalidValueError(f"{shown}: cannot be written: {_why(exc)}") from None
        os.close(fd)
        return
    full = os.path.realpath(full)  # a link to a missing file: the file it will create
    existing = os.path.dirname(full)
    while not os.path.lexists(existing):  # the nearest existing folder (the root exists)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidValueError(
            f"{shown}: {short_repr(existing)} is a file, so no folder can be made under it"
        )
    made: list[str] = []  # the folders the check makes, removed again after it
    try:
        _try_create(full, existing, shown, made)
    finally:
        for folder in reversed(made):
            os.rmdir(folder)


def _try_create(full: str, existing: str, shown: str, made: list[str]) -> None:
    # Make the file where it will be written, then remove it: the folders it needs, and the
    # file itself (its name too: a name the file system refuses fails here, not after the
    # run). Only what this makes is removed (O_EXCL: nothing that existed is touched).
    folder = os.path.dirname(full)
    missing = []
    while folder != existing:
        missing.append(folder)
        folder = os.path.dirname(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except OSError as exc:
            raise InvalidValueError(
                f"{shown}: cannot create the folder {short_repr(folder)}: {_why(exc)}"
            ) from None
        made.append(folder)
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        where = os.path.dirname(full)
        raise InvalidValueError(
            f"{shown}: cannot create files in {short_repr(where)}: {_why(exc)}"
        ) from None
    os.close(fd)
    os.unlink(full)


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def write_output(option: str, path: str, write: Callable[[str], Any]) -> str | None:
    """``write(path)``; or, if it fails, why, in one line naming ``option`` and the path.

    The file was checked before the run (:func:`check_output`), but some places refuse
    only when written (``/dev/full``: a full disk), or changed meanwhile.

    Example:
        >>> from speedflags._measure.output_paths import write_output
        >>> def write(path):
        ...     with open(path, "w") as fh:
        ...         fh.write("{}")
        >>> write_output("--json", "/dev/full", write)
        "--json '/dev/full': could not be written: No space left on device"
    """
    try:
        write(path)
    except OSError as exc:
        return f"{option} {short_repr(path)}: could not be written: {_why(exc)}"
    return None


def make_parent_folder(path: PathArg) -> None:
    """Create the folder ``path`` goes in, with its parents, if it is missing."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
