"""Telling speedflags' own writes from everyone else's, for :func:`speedflags.watch`.

``OWN_WRITES.depth`` is above zero, in the writing thread, while speedflags itself writes
torch state (a ledger frame opening, closing or rolling back, ``heal_tf32``, the pytest
plugin putting a leaked flag back); ``watch()`` records every other write as
``"external"``. :func:`section` is how the ledger and those writers say so: one ``with``
around the code that writes, entered while holding the ledger's lock.

When nothing is watching, :func:`section` returns one shared do-nothing context manager, so
a frame pays a function call and an empty ``with`` (nothing is read or counted). While
watching, a section is also a *boundary*: on entry the watcher compares every lever's state
with what it last knew (a difference is a change made around Python, reported as made by
unknown code between this boundary and the previous one), and on exit it learns the state
speedflags left.

This module imports nothing from torch and nothing else of speedflags (the ledger imports it).

Example:
    >>> import speedflags
    >>> from speedflags._own_writes import OWN_WRITES
    >>> OWN_WRITES.depth  # outside the ledger: any write now would be someone else's
    0
    >>> the_ledger = speedflags.ledger()
    >>> with speedflags.watch(), the_ledger._lock, section(the_ledger, "example", None):
    ...     OWN_WRITES.depth  # inside: speedflags' own
    1
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Protocol, Tuple

Where = Optional[Tuple[str, int]]


class _OwnWrites(threading.local):
    depth = 0  # a class attribute: every thread starts at 0 without initialising anything


OWN_WRITES = _OwnWrites()


class Watcher(Protocol):
    """What :mod:`speedflags._watcher` installs in :data:`WATCHER` while watching."""

    def boundary(self, ledger: Any, label: str, where: Where) -> None:
        """Before speedflags writes: report changes made around Python since the last one."""

    def settled(self, label: str, where: Where) -> None:
        """After speedflags wrote: remember the state it left (not an external change)."""

    def acquire(self) -> None:
        """Hold off Python writes of other threads while speedflags writes."""

    def release(self) -> None:
        """Let them go again."""


# Set and cleared by speedflags._watcher with the ledger's lock held, so that no section is
# half-way through when watching starts or stops.
WATCHER: Optional[Watcher] = None


class _Idle:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_IDLE = _Idle()


class _Watched:
    __slots__ = ("label", "ledger", "watcher", "where")

    def __init__(self, watcher: Watcher, ledger: Any, label: str, where: Where) -> None:
        self.watcher = watcher
        self.ledger = ledger
        self.label = label
        self.where = where

    def __enter__(self) -> None:
        self.watcher.acquire()
        OWN_WRITES.depth += 1
        try:
            self.watcher.boundary(self.ledger, self.label, self.where)
        except BaseException:
            OWN_WRITES.depth -= 1
            self.watcher.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.watcher.settled(self.label, self.where)
        finally:
            OWN_WRITES.depth -= 1
            self.watcher.release()


def section(ledger: Any, label: str, where: Where) -> Any:
    """The ``with`` around speedflags' own writes (enter it holding the ledger's lock).

    ``ledger`` receives the records of changes found at the boundary (the caller holds its
    lock); ``label`` and ``where`` name the boundary in them.
    """
    watcher = WATCHER
    if watcher is None:
        return _IDLE
    return _Watched(watcher, ledger, label, where)
