"""The public :class:`~speedflags.Frame`: one ``fast_math`` block or decorated call, as the
ledger sees it, and what makes one.

A frame knows its ledger only as something that closes it (:class:`Closes`), so this module
sits below the ledger and its parts, which all handle frames.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol

from .._short_repr import short_repr
from .._tracing import Where
from .history import format_where

if TYPE_CHECKING:  # (at run time, .program re-exports Frame until __init__ imports it here)
    from .program import Program

__all__ = ["Closes", "Frame", "without_closed"]


class Closes(Protocol):
    """What a :class:`Frame` needs of its ledger (:class:`~speedflags.FlagLedger` is one)."""

    def close(self, frame: Frame, where: Where = None) -> None:
        """Restore every lever of ``frame`` and close it."""


class Frame:
    """One ``fast_math`` block or decorated call, as the ledger sees it.

    ``with fast_math(...) as frame:`` binds it, and :meth:`FlagLedger.open
    <speedflags.FlagLedger.open>` returns it. Attributes: ``id``, ``label``, ``device``
    (the device the levers were resolved for), ``levers`` (names, in application order),
    ``values`` (what each lever was set to, after ``"auto"`` resolution), ``thread`` (the
    thread's name), ``rank`` (the process's ``torch.distributed`` rank, ``None`` without a
    process group), ``where``, ``closed`` and ``ledger`` (the ledger it was opened on).
    :meth:`close` restores what it found.

    Example:
        >>> import speedflags
        >>> with speedflags.fast_math(cudnn_benchmark=True, label="demo") as frame:
        ...     frame.label, frame.levers, frame.values, frame.closed
        ('demo', ('cudnn_benchmark',), {'cudnn_benchmark': True}, False)
        >>> frame.closed
        True
    """

    __slots__ = (
        "_where",
        "afters",
        "applied",
        "befores",
        "closed",
        "device",
        "id",
        "label",
        "ledger",
        "owner",
        "program",
        "rank",
        "suspending",
        "task",
        "thread",
        "thread_id",
        "token",
    )

    id: int  # given by the ledger when the frame opens
    ledger: Closes
    label: str
    owner: object
    thread_id: int
    thread: str
    token: int  # the thread's token in the ledger: dropped if the thread ends
    task: object  # the asyncio task that entered it, or None
    _where: Where
    device: str | None
    closed: bool
    program: Program
    rank: int | None
    befores: list[Any]
    afters: list[Any]
    applied: int
    # on a frame closing because the body of a decorated generator or coroutine suspends: a
    # dict its close fills with what the body holds (.suspend); unset or None on every other
    # frame, read with getattr, off the hot path
    suspending: dict[int, Any] | None

    def close(self, where: Where = None) -> None:
        """Restore every lever this frame set to the state it found, and close it:
        ``frame.ledger.close(frame, where)`` (see :meth:`speedflags.FlagLedger.close`).
        ``where`` (``(file, line)``) defaults to the caller's line.

        Example:
            >>> import speedflags
            >>> from speedflags.levers import PROCESS_LEVERS
            >>> frame = speedflags.ledger().open([(PROCESS_LEVERS["cudnn_benchmark"], True)])
            >>> frame.close()
            >>> frame.closed
            True
        """
        if where is None:
            caller = sys._getframe(1)
            where = (caller.f_code.co_filename, caller.f_lineno)
        self.ledger.close(self, where)

    def key(self, i: int) -> Hashable:
        """The stack key of lever ``i``: its domain, or (domain, thread) if thread-local."""
        key = self.program.keys[i]
        return (self.program.domains[i], self.thread_id) if key is None else key

    @property
    def where(self) -> str:
        return format_where(self._where)

    @property
    def levers(self) -> tuple[str, ...]:
        return tuple(lever.name for lever in self.program.levers[: self.applied])

    @property
    def values(self) -> dict[str, Any]:
        program = self.program
        return {
            program.levers[i].name: program.levers[i].describe_value(program.values[i])
            for i in range(self.applied)
        }

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Frame {self.id} {short_repr(self.label)} {state} at {self.where} in {self.thread}>"
        )


def without_closed(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """``frames`` less the closed frames at its end (those close() leaves in a context's
    tuple). A function of its own: a ``while`` loop inside the ledger's open() would be a hole
    in its ``try`` on Python 3.13 (tests/test_exception_table_holes.py)."""
    while frames and frames[-1].closed:
        frames = frames[:-1]
    return frames
