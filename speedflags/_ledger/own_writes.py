"""Telling speedflags' own writes from everyone else's, for :func:`speedflags.watch`.

``OWN_WRITES.depth`` is above zero, in the writing thread, while speedflags itself writes
torch state (a ledger frame opening, closing or rolling back, ``heal_tf32``, the pytest
plugin putting a leaked flag back); ``watch()`` records every other write as
``"external"``. The ledger marks its thread in ``_WRITING`` around each open and close;
``heal_tf32`` and the plugin use :func:`section`, one ``with`` around the code that writes,
entered while holding the ledger's lock.

When nothing is watching, the ledger only reads :data:`WATCHER` (``None``) and
:func:`section` returns one shared do-nothing context manager. While watching, a section
(the ledger's through :func:`enter`) is also a *boundary*: on entry the watcher compares
every lever's state with what it last knew (a difference is a change made around Python,
reported as made by unknown code between this boundary and the previous one), and on exit
it learns the state speedflags left.

This module imports no lever and no other part of the ledger (the ledger imports it).

Example:
    >>> import speedflags
    >>> from speedflags._ledger.own_writes import OWN_WRITES
    >>> OWN_WRITES.depth  # outside the ledger: any write now would be someone else's
    0
    >>> the_ledger = speedflags.ledger()
    >>> with speedflags.watch(), the_ledger._lock, section(the_ledger, "example", None):
    ...     OWN_WRITES.depth  # inside: speedflags' own
    1
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol

from .._tracing import Where

# The threads writing for speedflags right now: the ledger adds and discards its thread once
# per section (a set of ids, not a counter per thread: docs/architecture.md, "The hot path").
_WRITING: set[int] = set()
_get_ident = threading.get_ident


class _OwnWrites:
    """Tells whether the calling thread is writing flags for speedflags right now.

    Example:
        >>> from speedflags._ledger.own_writes import OWN_WRITES
        >>> OWN_WRITES.depth
        0
    """

    __slots__ = ()

    @property
    def depth(self) -> int:
        return 1 if _get_ident() in _WRITING else 0


OWN_WRITES = _OwnWrites()


class Watcher(Protocol):
    """What :mod:`speedflags._watch.watcher` installs in :data:`WATCHER` while watching."""

    def boundary(self, ledger: Any, label: str, where: Where) -> None:
        """Before speedflags writes: report changes made around Python since the last one."""

    def settled(self, label: str, where: Where, levers_only: bool = False) -> None:
        """After speedflags wrote: remember the state it left (not an external change);
        ``levers_only``: it wrote levers only (a ledger frame), so only they are read again."""


# Set and cleared by speedflags._watch.watcher with the ledger's lock held, so that no section is
# half-way through when watching starts or stops.
WATCHER: Watcher | None = None


class _Idle:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_IDLE = _Idle()


class _Watched:
    """A watched section; the caller holds the ledger's lock (which is the watcher's)."""

    __slots__ = ("added", "exited", "label", "ledger", "levers_only", "watcher", "where")

    def __init__(
        self, watcher: Watcher, ledger: Any, label: str, where: Where, levers_only: bool = False
    ) -> None:
        self.watcher = watcher
        self.ledger = ledger
        self.label = label
        self.where = where
        self.levers_only = levers_only
        self.added = False
        self.exited = False  # set once __exit__ completed (an interrupted ledger checks it)

    def __enter__(self) -> None:
        tid = _get_ident()
        self.added = tid not in _WRITING  # the ledger may have marked the thread already
        _WRITING.add(tid)
        try:
            self.watcher.boundary(self.ledger, self.label, self.where)
        except BaseException:
            self._unmark()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.watcher.settled(self.label, self.where, self.levers_only)
        finally:
            self._unmark()
            self.exited = True

    def _unmark(self) -> None:
        if self.added:
            _WRITING.discard(_get_ident())


def enter(ledger: Any, label: str, where: Where) -> Any:
    """Enter a watched section now (the ledger's hot path, which avoids ``with``): a ledger
    frame, which writes levers only."""
    watcher = WATCHER
    if watcher is None:
        return None
    watched = _Watched(watcher, ledger, label, where, levers_only=True)
    watched.__enter__()
    return watched


def leave(watched: Any) -> None:
    """Exit ``watched`` (what :func:`enter` returned) unless it is exited already.

    The ledger calls it on its interrupted paths, where the watcher's own error must not hide
    the one being handled.
    """
    if watched is not None and not watched.exited:
        with contextlib.suppress(Exception):
            watched.__exit__(None, None, None)


def section(ledger: Any, label: str, where: Where) -> Any:
    """The ``with`` around speedflags' own writes (enter it holding the ledger's lock).

    ``ledger`` receives the records of changes found at the boundary (the caller holds its
    lock); ``label`` and ``where`` name the boundary in them.
    """
    watcher = WATCHER
    if watcher is None:
        return _IDLE
    return _Watched(watcher, ledger, label, where)
