"""What the ledger runs: compiled Programs and the Frames they open."""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Union,
    cast,
)

from .._short_repr import short_repr
from ..errors import InvalidTypeError
from ..levers._base import Lever
from .history import Where, format_where, lever_key

if TYPE_CHECKING:
    from .ledger import FlagLedger

LeverItem = tuple[Lever, Any, str]  # (lever, requested value, reason to record)
# What FlagLedger.open and FlagLedger.frame take: a Program, or (lever, value) and
# (lever, value, reason) items
Levers = Union["Program", Iterable[tuple[Lever, Any] | tuple[Lever, Any, str]]]


class Program:
    """A frame's levers, compiled once: what the ledger needs on every enter and exit.

    ``@speedup`` enters and exits a frame every training step, so everything that depends
    only on the levers (domains, stack keys, hooks, which states to read) is worked out here.

    Example:
        >>> from speedflags._ledger.program import Program
        >>> from speedflags.levers import PROCESS_LEVERS
        >>> Program([(PROCESS_LEVERS["cudnn_benchmark"], True, "")]).domains
        ('cudnn_benchmark',)
    """

    __slots__ = (
        "back",
        "checks",
        "domains",
        "keys",
        "lever_keys",
        "levers",
        "n",
        "prev",
        "reads",
        "reasons",
        "rows",
        "seen",
        "skipped",
        "values",
    )

    def __init__(self, items: Sequence[LeverItem], skipped: Sequence[tuple[str, str]] = ()):
        self.levers: tuple[Lever, ...] = tuple(lever for lever, _, _ in items)
        self.lever_keys: tuple[str, ...] = tuple(lever_key(lever) for lever in self.levers)
        self.values: tuple[Any, ...] = tuple(value for _, value, _ in items)
        self.reasons: tuple[str, ...] = tuple(reason for _, _, reason in items)
        self.domains: tuple[str, ...] = tuple(lever.domain for lever in self.levers)
        # process-wide stacks are keyed by domain; thread-local ones by (domain, thread)
        self.keys: tuple[str | None, ...] = tuple(
            None if lever.scope == "thread" else lever.domain for lever in self.levers
        )
        # index of the previous lever of the same domain (it hands over its state), or -1
        self.prev: tuple[int, ...] = tuple(
            max((j for j in range(i) if self.domains[j] == self.domains[i]), default=-1)
            for i in range(len(self.levers))
        )
        self.checks: tuple[bool, ...] = tuple(
            bool(getattr(lever, "checks_state", True)) for lever in self.levers
        )
        self.skipped: tuple[tuple[str, str], ...] = tuple(skipped)
        self.n = len(self.levers)
        # What open() iterates over, precomputed: (index, lever, value, prev, key, domain)
        self.rows = tuple(
            zip(
                range(self.n),
                self.levers,
                self.values,
                self.prev,
                self.keys,
                self.domains,
                strict=True,
            )
        )
        # What close() iterates over: the rows in reverse order
        self.back = self.rows[::-1]
        # The levers whose state must be read (first of their domain), whether to check it,
        # and how a frame reads it: ``frame_read`` where a lever has one (sdpa: it lets
        # PyTorch make a pending write of its own first), else ``read``
        self.reads = tuple(
            (i, lever, self.checks[i], getattr(lever, "frame_read", lever.read))
            for i, lever in enumerate(self.levers)
            if self.prev[i] < 0
        )
        # The last state read for each of them that passed its check (see FlagLedger.open)
        self.seen: list[Any] = [None] * self.n

    @classmethod
    def of(cls, levers: Levers) -> Program:
        """``levers`` as a Program: itself if it is one, else compiled from its items,
        ``(lever, value)`` or ``(lever, value, reason)``, in the order they are applied.

        Example:
            >>> from speedflags._ledger.program import Program
            >>> from speedflags.levers import PROCESS_LEVERS
            >>> Program.of([(PROCESS_LEVERS["cudnn_benchmark"], True)]).reasons
            ('',)
        """
        if isinstance(levers, Program):
            return levers
        items: list[LeverItem] = []
        for item in cast(Iterable[object], levers):  # what a user passed: checked
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise InvalidTypeError(
                    f"levers: expected (lever, value) or (lever, value, reason) tuples, got "
                    f"{short_repr(item)}"
                )
            _check_lever(item[0])
            items.append((item[0], item[1], item[2] if len(item) == 3 else ""))
        return cls(items)


_METHODS = ("read", "check", "apply", "restore", "describe", "describe_value")


def _check_lever(lever: object) -> None:
    # A lever the ledger can use: the Lever protocol's names, a scope it knows (an
    # InvalidTypeError naming what is wrong, not an AttributeError from deep inside)
    lacks = [m for m in _METHODS if not callable(getattr(lever, m, None))]
    lacks += [a for a in ("name", "domain") if not isinstance(getattr(lever, a, None), str)]
    if getattr(lever, "scope", None) not in ("process", "thread"):
        lacks.append("scope ('process' or 'thread')")
    if not lacks:
        return
    hint = ""
    if isinstance(lever, str):
        hint = (
            " (a name: speedflags.levers.PROCESS_LEVERS maps names to levers, and "
            "speedflags.fast_math takes names)"
        )
    raise InvalidTypeError(
        f"levers: {short_repr(lever)} is not a lever{hint}: a lever follows the Lever protocol "
        f"(speedflags.levers._base.Lever); it lacks {', '.join(lacks)}"
    )


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
    ledger: FlagLedger
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


_new_object = object.__new__


def new_frame(
    label: str,
    owner: object,
    where: Where,
    device: str | None,
    program: Program,
    thread_id: int,
    thread: str,
    task: object,
    rank: int | None,
    token: int,
    ledger: FlagLedger,
) -> Frame:
    """A new :class:`Frame`, not opened yet (what :meth:`FlagLedger.open` makes; a function
    rather than ``Frame.__init__``: Python runs a plain function's call inline, a class's
    goes through ``type.__call__``, ~15 % of the frame object's cost)."""
    frame: Frame = _new_object(Frame)
    frame.id = 0
    frame.ledger = ledger
    frame.label = label
    frame.owner = owner
    frame.thread_id = thread_id
    frame.thread = thread
    frame.token = token
    frame.task = task
    frame._where = where
    frame.device = device
    frame.closed = False
    frame.program = program
    frame.rank = rank
    n = program.n
    frame.befores = [None] * n
    frame.afters = [None] * n
    frame.applied = 0
    return frame


def without_closed(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """``frames`` less the closed frames at its end (those close() leaves in a context's
    tuple). A function of its own: a ``while`` loop inside the ledger's open() would be a hole
    in its ``try`` on Python 3.13 (tests/test_exception_table_holes.py)."""
    while frames and frames[-1].closed:
        frames = frames[:-1]
    return frames
