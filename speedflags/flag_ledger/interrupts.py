"""Which code is a critical section, and signal handlers that never run inside one.

Python runs a signal handler between two bytecodes of the main thread, at the next check
point after the signal arrives (a call, a function's first instruction, a loop's back edge).
An exception the handler raises (``KeyboardInterrupt``, ``SystemExit``, a timeout) is raised
there. The ledger's own code catches such an exception wherever it lands inside an enter or
an exit, and rolls the enter back or completes the exit first. One place cannot be covered
from Python: the first instruction of ``__exit__``, which runs before any ``try`` in it.
:func:`signal_safe` closes it: a wrapped handler called while the main thread runs critical
code (the ledger's enter and exit, and ``__exit__``, which always goes on into the ledger's
exit) does not run there; it is queued, and the ledger runs it as soon as that enter or exit
is complete, outside its lock.

Code is registered by the modules that own it, with :func:`critical`. This module imports
nothing of speedflags but its errors.

Python 3.9 checks for signals between almost any two bytecodes (3.10 moved the checks to
calls and loop back edges, bpo-29988), so on 3.9 a handler can also run inside the code that
takes a frame from the ledger and hands it back: the except and finally clauses of
``__enter__`` and of the decorators' wrappers, before they reach the ledger, or just after a
``try`` block ended and before its ``finally`` clause began. A second interruption landing
there would leave the frame open. :func:`hand_off_after` marks that part of such a function
(from its call of the ledger or of the user's function on) as critical on Python 3.9.
"""

from __future__ import annotations

import dis
import functools
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, TypeVar

from ..errors import InvalidTypeError

F = TypeVar("F", bound=Callable[..., Any])
Handler = Callable[[int, Optional[FrameType]], Any]

_CRITICAL: Set[CodeType] = set()
_MAX_DEPTH = 40  # frames walked up from the interrupted one; the ledger's stacks are shallower
# Handler calls deferred out of critical code, run by deliver_pending() (main thread only).
PENDING: List[Tuple[Handler, int, Optional[FrameType]]] = []
_MAIN_THREAD = [threading.main_thread()]
# Python 3.9 only: a hand-off function's code -> the offset of the call from which on its own
# instructions are critical (see hand_off_after).
_HAND_OFFS: Dict[CodeType, int] = {}
_PER_OPCODE_CHECKS = sys.version_info < (3, 10)


def critical(func: F) -> F:
    """Mark ``func`` a critical section: a :func:`signal_safe` handler called while it (or
    anything it calls) runs is deferred until the ledger's enter or exit completes."""
    code = getattr(func, "__func__", func).__code__
    _CRITICAL.add(code)
    return func


def hand_off_after(name: str) -> Callable[[F], F]:
    """Mark the instructions of the decorated function from its call of ``name`` on as
    critical, on Python 3.9 (elsewhere it returns the function unchanged).

    For the functions that receive a frame from the ledger and must hand it back whatever
    happens: ``__enter__`` (``name="_open"``: once the ledger's open returned, the frame
    must reach the ``with`` statement or be cancelled), a decorator's wrapper (the user's
    function: once it returned, or raised, the frame must be closed). Only the function's
    own instructions count: while the user's function runs (a frame of its own), a handler
    runs at once. The call is found in the bytecode when the function is decorated; a
    function without it is a programming error (``ValueError``).

    Example:
        >>> @hand_off_after("print")
        ... def greet():
        ...     print("hello")
        ...     return 1
        >>> greet()
        hello
        1
    """

    def mark(func: F) -> F:
        if _PER_OPCODE_CHECKS:
            code = getattr(func, "__func__", func).__code__
            if code not in _HAND_OFFS:
                _HAND_OFFS[code] = _call_offset(code, name)
        return func

    return mark


def _call_offset(code: CodeType, name: str) -> int:
    # The first call instruction after the first load of ``name``. At a signal check point
    # Python 3.9's f_lasti is the instruction just executed: the call itself once it
    # returned (or raised, when the check is the one at its exception handler's start).
    loaded = False
    for instruction in dis.get_instructions(code):
        if not loaded:
            loaded = instruction.opname.startswith("LOAD_") and instruction.argval == name
        elif instruction.opname.startswith("CALL_"):
            return instruction.offset
    raise ValueError(f"hand_off_after({name!r}): {code.co_name} never calls {name!r}")


@critical  # see signal_safe's guarded: a signal arriving during the walk waits
def in_critical_section(frame: Optional[FrameType]) -> bool:
    """True if the Python frame ``frame`` (a signal handler's second argument), or one of
    its callers, runs speedflags' critical code (on Python 3.9 also: ``frame`` is in the
    critical part of a :func:`hand_off_after` function)."""
    if _HAND_OFFS and frame is not None:
        start = _HAND_OFFS.get(frame.f_code)
        if start is not None and frame.f_lasti >= start:
            return True
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
        if frame.f_code in _CRITICAL:
            return True
        frame = frame.f_back
        depth += 1
    return False


def deliver_pending() -> None:
    """Run the handler calls deferred out of critical code, oldest first (in the main thread
    only: a handler never runs in another thread). A handler's exception propagates; the
    calls after it stay queued for the next delivery."""
    if threading.current_thread() is not _MAIN_THREAD[0]:
        return
    while PENDING:
        handler, signum, frame = PENDING.pop(0)
        handler(signum, frame)


def forked() -> None:
    """In a forked child: the forking thread is the main thread now; nothing is pending."""
    _MAIN_THREAD[0] = threading.current_thread()
    PENDING.clear()


def signal_safe(handler: Handler) -> Handler:
    """Wrap a signal handler so that it never runs inside one of speedflags' enters or exits.

    Without it, an exception raised by a handler (Ctrl-C's ``KeyboardInterrupt``, a timeout,
    ``SystemExit`` from a SIGTERM handler) that lands inside an enter or exit is still
    handled: the ledger rolls the enter back, or completes the exit's restore, and then lets
    the exception through. What the ledger cannot catch is an exception raised at the very
    first instruction of a ``with`` statement's ``__exit__`` (before any ``try`` in it): the
    block's levers would then stay set. A wrapped handler called while speedflags' critical
    code runs is queued instead, and runs as soon as that enter or exit is complete (a
    few microseconds later), outside the ledger's lock; everywhere else it runs at once, as
    before. So a block entered from a wrapped handler nests normally.

    Scope: process (signal handlers run in the main thread). Changes and restores no flag.

    Example:
        >>> import signal, speedflags
        >>> def on_alarm(signum, frame):
        ...     raise TimeoutError("step took too long")
        >>> previous = signal.signal(signal.SIGALRM, speedflags.signal_safe(on_alarm))
        >>> signal.getsignal(signal.SIGALRM).__wrapped__ is on_alarm
        True
        >>> _ = signal.signal(signal.SIGALRM, previous)

        For Ctrl-C:
        ``signal.signal(signal.SIGINT, speedflags.signal_safe(signal.default_int_handler))``.
    """
    if not callable(handler):
        raise InvalidTypeError(
            f"signal_safe(handler=...): expected a callable taking (signum, frame), got "
            f"{type(handler).__name__}"
        )

    @functools.wraps(handler)
    def guarded(signum: int, frame: Optional[FrameType]) -> Any:
        if in_critical_section(frame):
            PENDING.append((handler, signum, frame))  # the ledger runs it once done
            return None
        return handler(signum, frame)

    # A signal arriving while this runs (a fast timer) waits too: were it to raise in here,
    # it would come out where this call was deciding to wait.
    critical(guarded)
    return guarded
