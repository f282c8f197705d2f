"""What the ledger runs: a frame's levers compiled once (:class:`Program`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union, cast

from .._short_repr import short_repr
from ..errors import InvalidTypeError
from ..levers._base import Lever
from .history import lever_key

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
            lever = check_lever(item[0])
            items.append((lever, item[1], item[2] if len(item) == 3 else ""))
        return cls(items)


def check_lever(lever: object) -> Any:
    """``lever`` as the ledger takes it: itself, or with the protocol's defaults for the
    members it leaves out (:func:`~speedflags.levers.own.completed`); an InvalidTypeError
    naming what is wrong, not an AttributeError from deep inside."""
    from ..levers.own import completed  # local: fast_math's programs are compiled, not checked

    try:
        whole = completed(lever)
    except InvalidTypeError as exc:
        hint = (
            " (a name: speedflags.levers.PROCESS_LEVERS maps names to levers, and "
            "speedflags.fast_math takes names)"
            if isinstance(lever, str)
            else ""
        )
        raise InvalidTypeError(f"levers: {exc}{hint}") from None
    lacks = [a for a in ("name", "domain") if not isinstance(getattr(whole, a, None), str)]
    if whole.scope not in ("process", "thread"):
        lacks.append(f"a scope the ledger keeps ('process' or 'thread', not {whole.scope!r})")
    if lacks:
        raise InvalidTypeError(
            f"levers: {short_repr(lever)} is not a lever: it lacks {', '.join(lacks)}"
        )
    return whole
