"""The ledger's history as it is kept: a ring of compact entries (:class:`Ring`, a part of
:class:`~speedflags.FlagLedger`), and what an entry is (:class:`Entry`, made by :func:`entry`).

The ledger appends one entry per frame operation (a frame's set, its restore) or event; the
per-lever :class:`~speedflags.FlagRecord` objects are built from them only when
``FlagLedger.history`` is read (:func:`expand`). An entry is an exact tuple of
:class:`Entry`'s fields holding only strings, numbers and exact tuples of them (lever keys,
not levers; the frame's label and id, not the frame), so that the garbage collector stops
tracking it (docs/architecture.md, "The hot path"); readers see it by name through
:func:`view`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from .._tracing import Where
from . import history as _history
from .history import FlagRecord, check_note

if TYPE_CHECKING:
    from .frame import Frame

now = time.time


class Entry(NamedTuple):
    """The fields of a history entry, one lever or more of one frame operation or event.

    A frame's ``set`` entry holds its levers in order of application; a ``restore`` entry
    holds what each lever read on exit (``befores``) and after its restore (``afters``),
    and its records are in reverse order (the order of the restores); any other ``action``
    is a single record (an event, a skip, a re-applied or rolled-back lever).
    """

    action: str  # "set", "restore", or the single record's action ("heal", "skip", ...)
    seq: int  # the first record's position in the history
    time: float  # time.time() of the operation
    label: str
    frame: int  # the frame's id (0 for an event)
    thread: str  # the thread's name
    rank: int | None
    where: Where
    levers: tuple[str, ...]  # lever keys (history.lever_key), or an event's name
    reasons: tuple[str, ...] | None  # per lever (None: all empty)
    befores: tuple[Any, ...]
    afters: tuple[Any, ...]


def entry(
    action: str,
    seq: int,
    when: float,
    label: str,
    frame: int,
    thread: str,
    rank: int | None,
    where: Where,
    levers: tuple[str, ...],
    reasons: tuple[str, ...] | None,
    befores: tuple[Any, ...],
    afters: tuple[Any, ...],
) -> tuple[Any, ...]:
    """An entry with :class:`Entry`'s fields, as an exact tuple (the one constructor)."""
    return (action, seq, when, label, frame, thread, rank, where, levers, reasons, befores,
            afters)  # fmt: skip


def view(raw: tuple[Any, ...]) -> Entry:
    """``raw``, an entry of the history, with its fields named."""
    return Entry._make(raw)


def expand(raw: tuple[Any, ...]) -> list[FlagRecord]:
    """The records one entry stands for, in ``seq`` order."""
    e = view(raw)
    n = len(e.levers)
    order = range(n - 1, -1, -1) if e.action == "restore" else range(n)
    origin = (e.time, e.label, e.frame, e.thread, e.rank, e.where)
    reasons = e.reasons
    return [
        FlagRecord(e.seq + k, e.levers[i], e.action, e.befores[i], e.afters[i],
                   reasons[i] if reasons else "", origin)
        for k, i in enumerate(order)
    ]  # fmt: skip


def records(entries: tuple[tuple[Any, ...], ...], limit: int) -> tuple[FlagRecord, ...]:
    """The last ``limit`` records of ``entries`` (oldest first)."""
    out: list[FlagRecord] = []
    for raw in entries:
        out.extend(expand(raw))
    return tuple(out[-limit:])


class Origin(NamedTuple):
    """Who made a record."""

    label: str
    frame: int  # the frame's id (0 for an event)
    thread: str  # the thread's name
    rank: int | None


def origin_of(frame: Frame) -> Origin:
    """Who made ``frame``'s records."""
    return Origin(frame.label, frame.id, frame.thread, frame.rank)


class Ring:
    """The ledger's history (a part of :class:`~speedflags.FlagLedger`): a ring of compact
    entries holding the most recent ``size`` records, and the last record's ``seq``.

    Every method is called with the ledger's lock held. The hot path (a frame's ``set``
    entry, and the ``restore`` entry of a close that was not interrupted) appends to
    ``entries`` and advances ``seq`` itself, with :func:`entry`.

    Example:
        >>> from speedflags._ledger.ring import Ring
        >>> ring = Ring(2)
        >>> _ = [ring.one(("", 0, "main", None), None, "note", "event", str(i), None, None)
        ...      for i in range(3)]
        >>> [r.reason for r in ring.records()]  # the two most recent
        ['1', '2']
    """

    __slots__ = ("entries", "seq", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        # each entry holds one or more records, so the ring never needs more entries than
        # records kept
        self.entries: deque[tuple[Any, ...]] = deque(maxlen=size)
        self.seq = 0

    def __len__(self) -> int:
        return len(self.entries)

    def records(self) -> tuple[FlagRecord, ...]:
        """The most recent records, oldest first (built now)."""
        return records(tuple(self.entries), self.size)

    def clear(self) -> None:
        self.entries.clear()

    def one(
        self,
        origin: Origin,
        where: Where,
        lever: str,
        action: str,
        reason: str,
        before: Any,
        after: Any,
    ) -> tuple[Any, ...]:
        """Append a single record (an event, a skip, a re-applied lever) made by ``origin``;
        return its entry."""
        self.seq += 1
        label, frame_id, thread, rank = origin
        raw = entry(action, self.seq, now(), label, frame_id, thread, rank, where, (lever,),
                    (reason,), (before,), (after,))  # fmt: skip
        self.entries.append(raw)
        return raw

    def note(
        self,
        lever: str,
        action: str,
        reason: str,
        before: Any,
        after: Any,
        label: str,
        where: Where,
    ) -> FlagRecord:
        """An event that is not a frame, with the calling thread's name and the rank;
        refused (:func:`~.history.check_note`) unless ``to_json()`` can write it."""
        check_note(lever=lever, action=action, reason=reason, label=label, before=before,
                   after=after)  # fmt: skip
        origin = Origin(label, 0, threading.current_thread().name, _history.rank_source())
        return expand(self.one(origin, where, lever, action, reason, before, after))[0]

    def frame_one(
        self, frame: Frame, where: Where, i: int, action: str, reason: str, before: Any, after: Any
    ) -> None:
        """A single record of lever ``i`` of ``frame``."""
        key = frame.program.lever_keys[i]
        self.one(origin_of(frame), where, key, action, reason, before, after)

    def skips(self, frame: Frame, where: Where) -> None:
        """The ``skip`` records of the levers ``frame``'s program leaves out."""
        origin = origin_of(frame)
        for name, reason in frame.program.skipped:
            self.one(origin, where, name, "skip", reason, None, None)

    def closed(
        self,
        frame: Frame,
        where: Where,
        found: list[Any],
        restored: list[Any],
        notes: list[str] | None,
    ) -> None:
        """The ``restore`` records of ``frame``'s exit, lever by lever (by index, in
        application order): what it read, what it left, a note (``notes`` None: none). For
        exits finished off the hot path (interrupted, abandoned); ``FlagLedger.close``
        appends the same entry itself."""
        n = len(found)
        program = frame.program
        kept = tuple(notes) if notes else None
        self.seq = seq = self.seq + n
        self.entries.append(
            entry("restore", seq - n + 1, now(), frame.label, frame.id, frame.thread,
                  frame.rank, where, program.lever_keys[:n], kept, tuple(found),
                  tuple(restored))
        )  # fmt: skip

    def closed_last(self, frame: Frame) -> bool:
        """Whether the last entry is ``frame``'s restore (an interrupted exit may have made it)."""
        if not self.entries:
            return False
        last = view(self.entries[-1])
        return last.action == "restore" and last.frame == frame.id
