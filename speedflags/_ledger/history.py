"""The ledger's history: compact ring entries, and the :class:`FlagRecord` views built from them.

:class:`History` is the ledger's part that keeps them: the ledger appends one tuple per frame
operation (a frame's set, its restore) or event; the per-lever :class:`FlagRecord` objects
are built only when ``history`` is read. Entries hold
only strings, numbers and exact tuples of them (lever keys, not levers; the frame's label
and id, not the frame): the garbage collector can stop tracking such tuples, so the ring
does not cost a traversal on every collection (measured: the collector was ~23% of a
frame's cost while entries referenced frames).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from .._short_repr import short_repr
from .._version import __version__
from ..errors import InvalidTypeError
from ..levers._base import Lever, Unreadable

if TYPE_CHECKING:
    from .program import Frame

Where = tuple[str, int] | None

now = time.time

# Entries: (kind, seq, time, label, frame id, thread name, rank, where, ...), then
#   SET:     lever keys, reasons, befores, afters    one record per lever, in order
#   RESTORE: lever keys, notes, found, restored      one record per lever, reverse order
#   ONE:     lever key or name, action, reason, before, after     a single record
SET, RESTORE, ONE = 0, 1, 2

# lever key ("name@domain") -> lever, so records describe states without the history holding
# lever objects; filled as programs are compiled
_LEVERS: dict[str, Lever] = {}


def lever_key(lever: Lever) -> str:
    """The key a history entry names ``lever`` by (and registers it under)."""
    key = f"{lever.name}@{lever.domain}"
    _LEVERS.setdefault(key, lever)
    return key


def format_where(where: Where) -> str:
    """``"train.py:42"`` for a ``(filename, lineno)`` pair; ``""`` when unknown.

    Example:
        >>> from speedflags._ledger.history import format_where
        >>> format_where(("train.py", 42)), format_where(None)
        ('train.py:42', '')
    """
    if where is None:
        return ""
    return f"{where[0]}:{where[1]}"


# FlagRecord.to_dict's keys, in order
RECORD_FIELDS = ("seq", "time", "lever", "action", "before", "after", "reason", "label", "frame",
                 "thread", "rank", "where")  # fmt: skip


def _no_rank() -> int | None:
    return None


# Tells the calling process's rank in a torch.distributed job (None without one);
# speedflags._distributed installs the real source, so the ledger needs no torch.distributed.
# Read once per frame (as history.rank_source, so that an installed source is seen).
rank_source: Callable[[], int | None] = _no_rank


def set_rank_source(source: Callable[[], int | None]) -> None:
    """Install the function that says the process's rank (``speedflags._distributed`` does)."""
    global rank_source
    rank_source = source


class FlagRecord:
    """One entry of the ledger's history: what happened to one lever, where and why.

    Attributes:
        seq: position in the process's history (increasing).
        time: ``time.time()`` of the frame's entry or exit (or of the event).
        lever: the lever's name (``"tf32"``), or ``"speedup"`` and the like for events.
        action: ``"set"``, ``"restore"``, ``"skip"`` or ``"heal"`` (and event names).
        before, after: the lever's observable state before and after (JSON-friendly).
        reason: why, in words: no effect on this device, drift found, rolled back, ...
        label: the frame's label (``"fast_math(tf32=True)"``).
        frame: the frame's id (a set and its restore share it; 0 for events).
        thread: the name of the thread that made the change.
        rank: the process's rank in its ``torch.distributed`` process group when the frame
            was entered (``None`` without a process group).
        where: ``"file.py:line"`` of the user code that entered or exited the block.

    Example:
        >>> import speedflags
        >>> with speedflags.fast_math(cudnn_benchmark=True, label="demo"):
        ...     pass
        >>> record = speedflags.ledger().history[-1]
        >>> record.lever, record.action, record.before, record.after, record.label
        ('cudnn_benchmark', 'restore', True, False, 'demo')
        >>> record == speedflags.ledger().history[-1]  # records compare by value
        True
    """

    __slots__ = (
        "_after",
        "_before",
        "_describe",
        "action",
        "frame",
        "label",
        "lever",
        "rank",
        "reason",
        "seq",
        "thread",
        "time",
        "where",
    )

    def __init__(
        self,
        seq: int,
        when: float,
        label: str,
        frame: int,
        thread: str,
        rank: int | None,
        where: Where,
        lever: str,
        action: str,
        reason: str,
        before: Any,
        after: Any,
    ) -> None:
        self.seq = seq
        self.rank = rank
        self.time = when
        registered = _LEVERS.get(lever)
        if registered is None:  # an event, or a lever named directly (skips, notes)
            self.lever = lever
            self._describe: Callable[[Any], Any] | None = None
        else:
            self.lever = registered.name
            self._describe = registered.describe
        self.action = action
        self.reason = reason
        self.label = label
        self.frame = frame
        self.thread = thread
        self.where = format_where(where)
        self._before = before
        self._after = after

    @property
    def before(self) -> Any:
        return self._described(self._before)

    @property
    def after(self) -> Any:
        return self._described(self._after)

    def _described(self, state: Any) -> Any:
        # None: no state was read (a thread-local lever of a thread that ended inside its
        # block); every lever reads a state of its own, never None
        if self._describe is None or state is None:
            return state
        return self._describe(state)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain, JSON-friendly values."""
        return {name: getattr(self, name) for name in RECORD_FIELDS}

    def _key(self) -> tuple[Any, ...]:
        return (
            (self.seq, self.time, self.lever, self.action, self._before, self._after),
            (self.reason, self.label, self.frame, self.thread, self.rank, self.where),
        )

    def __eq__(self, other: object) -> bool:
        # value equality: each read of ``history`` builds new records of the same entries
        if not isinstance(other, FlagRecord):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        # the states are left out: a note's may be a dict (unhashable); equal records share
        # the rest
        return hash((self.seq, self.time, self.lever, self.action, self.frame))

    def __repr__(self) -> str:
        reason = f", reason={self.reason!r}" if self.reason else ""
        rank = f", rank={self.rank!r}" if self.rank is not None else ""
        return (
            f"FlagRecord(lever={self.lever!r}, action={self.action!r}, before={self.before!r}, "
            f"after={self.after!r}{reason}, label={self.label!r}{rank}, where={self.where!r})"
        )


def expand(entry: tuple[Any, ...]) -> list[FlagRecord]:
    """The records one ring entry stands for, in ``seq`` order."""
    kind, seq, when, label, frame, thread, rank, where = entry[:8]
    if kind == ONE:
        lever, action, reason, before, after = entry[8:]
        return [
            FlagRecord(
                seq, when, label, frame, thread, rank, where, lever, action, reason, before, after
            )
        ]
    if kind == SET:
        keys, reasons, befores, afters = entry[8:]
        return [
            FlagRecord(seq + i, when, label, frame, thread, rank, where, keys[i], "set", reasons[i],
                       befores[i], afters[i])
            for i in range(len(keys))
        ]  # fmt: skip
    keys, notes, found, restored = entry[8:]
    n = len(keys)
    return [
        FlagRecord(seq + k, when, label, frame, thread, rank, where, keys[i], "restore",
                   notes[i] if notes else "", found[i], restored[i])
        for k, i in enumerate(range(n - 1, -1, -1))
    ]  # fmt: skip


def records(entries: Iterable[tuple[Any, ...]], limit: int) -> tuple[FlagRecord, ...]:
    """The last ``limit`` records of ``entries`` (oldest first)."""
    out: list[FlagRecord] = []
    for entry in entries:
        out.extend(expand(entry))
    return tuple(out[-limit:])


def json_default(value: Any) -> Any:
    """``json.dumps`` fallback for the values speedflags records.

    Example:
        >>> import json
        >>> from speedflags._ledger.history import json_default
        >>> json.dumps({"backends": frozenset({"math", "flash"})}, default=json_default)
        '{"backends": ["flash", "math"]}'
    """
    if isinstance(value, Unreadable):
        return value.to_json()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def check_note(**given: Any) -> None:
    """``InvalidTypeError`` unless a note's texts are strings and ``before`` and ``after``
    export as JSON (a note ``to_json()`` cannot write would break every later export)."""
    for name, value in given.items():
        if name in ("before", "after"):
            try:
                json.dumps(value, default=json_default)
                continue
            except (TypeError, ValueError) as exc:  # a key that is not a str; a cycle
                why = f"not exportable: {exc}; to_json() needs str keys and no cycles"
        elif isinstance(value, str):
            continue
        else:
            why = f"expected a str, got {type(value).__name__}"
        raise InvalidTypeError(f"ledger.note({name}={short_repr(value)}): {why}")


def to_json(history: Iterable[FlagRecord], indent: int | None = None) -> str:
    """``history`` as JSON, with the PyTorch and speedflags versions and the process id."""
    payload = {
        "speedflags": __version__,
        "torch": torch.__version__,
        "pid": os.getpid(),
        "records": [r.to_dict() for r in history],
    }
    return json.dumps(payload, indent=indent, default=json_default)


class History:
    """The ledger's history (a part of :class:`~speedflags.FlagLedger`): a ring of compact
    entries holding the most recent ``size`` records, and the last record's ``seq``.

    Every method is called with the ledger's lock held. The hot path (a frame's ``set``
    entry, and the ``restore`` entry of a close that was not interrupted) appends to
    ``entries`` and advances ``seq`` itself, in the layout above.

    Example:
        >>> from speedflags._ledger.history import History
        >>> ring = History(2)
        >>> _ = [ring.one("", 0, "main", None, None, "note", "event", str(i), None, None)
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
        label: str,
        frame_id: int,
        thread: str,
        rank: int | None,
        where: Where,
        lever: str,
        action: str,
        reason: str,
        before: Any,
        after: Any,
    ) -> tuple[Any, ...]:
        """Append a single record (an event, a skip, a re-applied lever); return its entry."""
        self.seq += 1
        entry = (ONE, self.seq, now(), label, frame_id, thread, rank, where, lever, action,
                 reason, before, after)  # fmt: skip
        self.entries.append(entry)
        return entry

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
        refused (:func:`check_note`) unless ``to_json()`` can write it."""
        check_note(lever=lever, action=action, reason=reason, label=label, before=before,
                   after=after)  # fmt: skip
        thread = threading.current_thread().name
        entry = self.one(label, 0, thread, rank_source(), where, lever, action, reason, before,
                         after)  # fmt: skip
        return expand(entry)[0]

    def frame_one(
        self, frame: Frame, where: Where, i: int, action: str, reason: str, before: Any, after: Any
    ) -> None:
        """A single record of lever ``i`` of ``frame``."""
        key = frame.program.lever_keys[i]
        self.one(frame.label, frame.id, frame.thread, frame.rank, where, key, action, reason,
                 before, after)  # fmt: skip

    def skips(self, frame: Frame, where: Where) -> None:
        """The ``skip`` records of the levers ``frame``'s program leaves out."""
        for name, reason in frame.program.skipped:
            self.one(frame.label, frame.id, frame.thread, frame.rank, where, name, "skip",
                     reason, None, None)  # fmt: skip

    def closed(
        self,
        frame: Frame,
        where: Where,
        found: list[Any],
        restored: list[Any],
        notes: list[str] | None,
    ) -> None:
        """The ``restore`` records of ``frame``'s exit: what each lever read, and after. For
        exits finished off the hot path (interrupted, abandoned); ``FlagLedger.close``
        appends the same entry itself."""
        n = len(found)
        self.seq = seq = self.seq + n
        self.entries.append(
            (RESTORE, seq - n + 1, now(), frame.label, frame.id, frame.thread, frame.rank,
             where, frame.program.lever_keys[:n], tuple(notes) if notes else None,
             tuple(found), tuple(restored))
        )  # fmt: skip

    def closed_last(self, frame: Frame) -> bool:
        """Whether the last entry is ``frame``'s restore (an interrupted exit may have made it)."""
        last = self.entries[-1] if self.entries else None
        return last is not None and last[0] == RESTORE and last[4] == frame.id
