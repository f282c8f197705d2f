"""The ledger's frame API in its context form: :class:`FrameScope`.

A scope is a set of levers to hold in a frame, reusable and reentrant, in the manner of
``unittest.mock.patch``: ``with scope as frame:``, ``async with scope``, ``scope.start()`` /
``scope.stop()``, and ``@scope`` on a function (one frame per call, or per step of a
generator or coroutine). Every enter opens a new frame on the scope's ledger
(:meth:`FlagLedger.open <speedflags.FlagLedger.open>`), owned by the scope; every exit closes
the scope's innermost frame in the calling thread or asyncio task. Interruptions around them
are handled here and in :mod:`.entering`, once, for every caller: ``fast_math`` specs are
scopes whose levers come from their plan.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._tracing import KeptOut, Where, at_trace_time, eager_where, hooked, is_compiling
from ..errors import SpeedflagsError
from .decorate import decorate
from .entering import close_innermost, close_left_open, innermost_here
from .frame import Frame
from .interrupts import PENDING, critical, deliver_pending
from .program import Levers, Program

if TYPE_CHECKING:
    from .protocol import FrameLedger

__all__ = ["FrameScope"]

F = TypeVar("F", bound=Callable[..., Any])
_getframe = sys._getframe


class FrameScope:
    """Levers held in a ledger frame: ``with``, ``async with``, ``start()``/``stop()``, ``@``.

    Build one with :meth:`FlagLedger.frame <speedflags.FlagLedger.frame>` (or subclass it,
    as :class:`~speedflags.FastMath` does, overriding :meth:`open_frame`). It is reusable and
    reentrant: each enter opens a frame of its own.

    - ``with scope as frame:`` / ``async with scope as frame:``: a frame for the block.
    - ``frame = scope.start()`` ... ``scope.stop()``: the same, across calls (``stop()``
      closes the scope's innermost frame in this thread or asyncio task, and does nothing
      if it has none, as ``unittest.mock.patch``'s does).
    - ``@scope``: a frame per call of a function, or per step of a generator, coroutine or
      async generator (not while it is suspended).

    Interruptions (Ctrl-C, any exception a signal handler raises) are handled: an enter
    opens its frame whole or not at all, even if interrupted just after the ledger opened
    it; an exit interrupted before the ledger's close began closes the frame all the same;
    a :func:`~speedflags.signal_safe` handler held back meanwhile runs once the enter or
    exit is complete (``docs/architecture.md``, "Interrupts, signals and fork").

    Scope: that of its levers (process-wide, or per thread for autocast); frames nest per
    thread and per asyncio task. Restores: every lever its frame set, to the state the frame
    found, on each exit.

    Example:
        >>> import torch, speedflags
        >>> from speedflags.levers import PROCESS_LEVERS
        >>> scope = speedflags.ledger().frame(
        ...     [(PROCESS_LEVERS["cudnn_benchmark"], True)], label="bench on")
        >>> with scope as frame:
        ...     torch.backends.cudnn.benchmark, frame.label
        (True, 'bench on')
        >>> frame = scope.start()
        >>> torch.backends.cudnn.benchmark
        True
        >>> scope.stop()
        >>> torch.backends.cudnn.benchmark, frame.closed
        (False, True)
    """

    # ``_ready``: (program, device) while an enter needs nothing but to open them on
    # ``self.ledger`` (the enters below then call the ledger without ``open_frame``); None
    # while a subclass has work of its own on entry (``FastMath``'s first entry)
    __slots__ = ("_label", "_ready", "ledger")

    def __init__(
        self,
        levers: Levers,
        *,
        ledger: FrameLedger,
        label: str = "",
        device: str | None = None,
    ) -> None:
        self.ledger = ledger  # the ledger its frames open on
        self._label = label
        self._ready: tuple[Program, str | None] | None = (Program.of(levers), device)

    @property
    def label(self) -> str:
        """The label of its frames (of each call's, for a decorated function: prefixed by
        the function's name)."""
        return self._label

    def open_frame(self, label: str, where: Where) -> Frame:
        """Open one frame of this scope, owned by it (what every enter, start and decorated
        call runs, inside the interrupt handling). A subclass that works its levers out
        lazily (``FastMath``: its plan) overrides this; it must open at most one frame, on
        ``self.ledger``, with ``self`` as its owner, and set ``_ready`` once an enter needs
        nothing more than the ledger's open."""
        ready = self._ready
        if ready is None:  # pragma: no cover - a subclass that clears it overrides this
            raise NotImplementedError(f"{type(self).__name__}.open_frame")
        return self.ledger.open(ready[0], label, where, self, ready[1])

    # --- with, start and stop ------------------------------------------------------------
    # An exception can interrupt an enter between the ledger's open and its return, or an
    # exit between its start and the ledger's close: the except clauses below close the
    # frame opened, or that the exit never reached. The exits are critical code: a
    # signal_safe handler called at their first instruction (no except clause yet) waits for
    # the close. ``async with`` calls the enter inside an except clause of its own (an
    # exception can land between the enter's return and its own); its exit repeats the
    # body, the close's common case excepted.

    def __enter__(self, where: Where = None) -> Frame:
        """Open a frame of this scope and return it: ``with scope as frame:``, or
        ``frame = scope.start()`` until ``scope.stop()``. ``where`` (``(file, line)``, for
        the records) defaults to the caller's line."""
        if is_compiling() or hooked():  # inside torch.compile: traced, or eager in it
            return self.enter_in_graph()
        if where is None:
            caller = _getframe(1)
            where = (caller.f_code.co_filename, caller.f_lineno)
        the_ledger = self.ledger
        mark = the_ledger.stacks.last_id
        try:
            ready = self._ready
            if ready is not None:  # open_frame's work, inline (the hot path)
                return the_ledger.open(ready[0], self._label, where, self, ready[1])
            return self.open_frame(self._label, where)
        except BaseException:
            close_left_open(the_ledger, self, where, opened_after=mark)
            raise

    start = __enter__  # ``frame = scope.start()``: a frame until ``scope.stop()``

    @critical
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        in_graph = False  # a constant store: no check point before the try
        try:  # first: no exception may land between the exit's start and its try
            if is_compiling() or hooked():
                in_graph = True
            else:
                caller = _getframe(1)
                where = (caller.f_code.co_filename, caller.f_lineno)
                the_ledger = self.ledger
                frames = the_ledger.stacks.context.get()  # close_innermost's common case, inline
                frame = frames[-1] if frames else None
                if frame is not None and frame.owner is self and not frame.closed:
                    the_ledger.close(frame, where)
                else:
                    close_innermost(the_ledger, self, where)
        except SpeedflagsError:
            raise
        except BaseException:
            close_left_open(self.ledger, self)
            raise
        finally:
            if in_graph:
                # Inside torch.compile (traced, or eager in it): out of the try, where a
                # graph break can resume
                self.exit_in_graph()
            # the drain (interrupts.py): handlers held back by this exit
            while True:
                if not PENDING:
                    break
                deliver_pending()

    async def __aenter__(self) -> Frame:
        caller = _getframe(1)
        where = (caller.f_code.co_filename, caller.f_lineno)
        mark = self.ledger.stacks.last_id
        try:  # __enter__ closes what it opened if interrupted; this, if interrupted after it
            return self.__enter__(where)
        except BaseException:
            close_left_open(self.ledger, self, where, opened_after=mark)
            raise

    @critical
    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:  # first: no exception may land between the exit's start and its try
            caller = _getframe(1)
            close_innermost(self.ledger, self, (caller.f_code.co_filename, caller.f_lineno))
        except SpeedflagsError:
            raise
        except BaseException:
            close_left_open(self.ledger, self)
            raise
        finally:  # a signal_safe handler held back here; no check point after the last test
            while True:  # the drain (interrupts.py): no check point after its last test
                if not PENDING:
                    break
                deliver_pending()

    @critical
    def stop(self, where: Where = None) -> None:
        """Close this scope's innermost open frame in this thread (or asyncio task),
        restoring what it found; nothing if it has none (an interrupted ``start()`` that
        opened nothing). ``where`` defaults to the caller's line.

        Raises:
            LedgerOrderError: the scope has no frame open in this thread but one open in
                another (as ``__exit__`` there does): nothing is restored; the frame stays
                open for its own thread.
        """
        in_graph = False  # a constant store: no check point before the try
        try:  # first: no exception may land between the stop's start and its try
            if is_compiling() or hooked():
                in_graph = True
            else:
                if where is None:
                    caller = _getframe(1)
                    where = (caller.f_code.co_filename, caller.f_lineno)
                frame = self.ledger.stacks.find(self)
                if frame is not None:
                    self.ledger.close(frame, where)
                elif self.ledger.stacks.elsewhere(self) is not None:  # as __exit__ there
                    innermost_here(self.ledger, self)  # raises: another thread's frame
        except SpeedflagsError:
            raise
        except BaseException:
            close_left_open(self.ledger, self, where)
            raise
        finally:
            if in_graph:
                self.exit_in_graph()
            while True:  # the drain (interrupts.py): handlers held back by this stop
                if not PENDING:
                    break
                deliver_pending()

    # --- a decorator -----------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        """``func`` wrapped: a frame of this scope per call (per step of a generator or
        coroutine), labelled ``"<qualname>: <label>"``."""
        label = f"{getattr(func, '__qualname__', repr(func))}: {self._label}"
        return decorate(func, self, "FrameScope", label)

    # --- inside torch.compile --------------------------------------------------------------

    def enter_in_graph(self) -> Frame:
        """What an enter does inside ``torch.compile`` (traced, or eager in compiled code):
        by default, the same enter eagerly, out of dynamo's way (a graph break)."""
        if is_compiling():
            _prepared()
        else:
            KeptOut.prepare()
        frame: Frame = ENTER.call(self)
        return frame

    def exit_in_graph(self) -> None:
        """What an exit does inside ``torch.compile``: the same exit, out of dynamo's way."""
        if is_compiling():
            _prepared()
        else:
            KeptOut.prepare()
        EXIT.call(self)

    def __repr__(self) -> str:
        return f"<FrameScope {self._label!r}>"


@at_trace_time
def _prepared() -> tuple[()]:
    KeptOut.prepare()
    return ()


def _enter_eagerly(scope: FrameScope) -> Frame:
    return scope.start(eager_where())


@critical
def _exit_eagerly(scope: FrameScope) -> None:
    try:
        close_innermost(scope.ledger, scope, eager_where())
    except SpeedflagsError:
        raise
    except BaseException:
        close_left_open(scope.ledger, scope)
        raise
    finally:
        while True:  # the drain (interrupts.py): no check point after its last test
            if not PENDING:
                break
            deliver_pending()


# A scope's enter and exit met inside torch.compile, run eagerly (a graph break): the levers
# really in force, restored after.
ENTER = KeptOut(_enter_eagerly)
EXIT = KeptOut(_exit_eagerly)
