"""What the ledger's history says: :class:`FlagRecord`, its JSON, and the words it is made of.

A :class:`FlagRecord` is one lever's view of one entry of the history (kept compact by
:mod:`.ring`), built only when ``FlagLedger.history`` is read. Here too: the key a record
names its lever by (:func:`lever_key`) and the process's rank (:data:`rank_source`, which
``speedflags._distributed`` installs). This module knows nothing of frames: every part of
the ledger may import it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._short_repr import short_repr
from .._tracing import Where
from .._version import __version__
from ..errors import InvalidTypeError
from ..levers._base import Lever, Unreadable

# lever key ("name@domain") -> lever, so records describe states without the history holding
# lever objects; filled as programs are compiled
_LEVERS: dict[str, Lever] = {}


def lever_of(key: str) -> Lever | None:
    """The lever a history entry names by ``key``; None for an event's name."""
    return _LEVERS.get(key)


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


def no_rank() -> int | None:
    """The rank without a process group (the ledger does not call it: a frame's rank is
    then ``None`` at no cost)."""
    return None


# Tells the calling process's rank in a torch.distributed job (None without one);
# speedflags._distributed installs the real source, so the ledger needs no torch.distributed.
# Read once per frame (as history.rank_source, so that an installed source is seen).
rank_source: Callable[[], int | None] = no_rank


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
        lever: str,
        action: str,
        before: Any,
        after: Any,
        reason: str,
        origin: tuple[float, str, int, str, int | None, Where],
    ) -> None:
        # ``lever``: a lever key (history.lever_key), or an event's name; ``origin``: the
        # entry's (time, label, frame id, thread, rank, where)
        self.seq = seq
        self.time, self.label, self.frame, self.thread, self.rank, where = origin
        registered = _LEVERS.get(lever)
        if registered is None:  # an event, or a lever named directly (skips, notes)
            self.lever = lever
            self._describe: Callable[[Any], Any] | None = None
        else:
            self.lever = registered.name
            self._describe = registered.describe
        self.action = action
        self.reason = reason
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
