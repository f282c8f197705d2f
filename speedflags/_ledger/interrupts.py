"""Which code is a critical section, signal handlers that never run inside one, and the drain
that runs those held back.

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

**The drain.** Every way out of critical code (an enter that completes, fails or is refused,
an exit, a step's end) ends in this loop, written as is in the critical function itself,
never in a function of its own::

    while True:  # the drain (interrupts.py): no check point after its last test
        if not PENDING:
            break
        deliver_pending()

A function would not do: the call's return is itself a check point on Python 3.10, where a
handler held back in the critical caller would then wait until the next enter or exit; and
``while PENDING:`` takes a jump on its way out, another 3.10 check point.
``tests/test_ledger_one_source.py`` checks that every copy is this loop, in critical code.
Why each point is or is not a check point, by Python version: ``docs/architecture.md``
("Interrupts, signals and fork").
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

from ..errors import InvalidTypeError

F = TypeVar("F", bound=Callable[..., Any])
Handler = Callable[[int, FrameType | None], Any]

_CRITICAL: set[CodeType] = set()
_MAX_DEPTH = 40  # frames walked up from the interrupted one; the ledger's stacks are shallower
# Handler calls deferred out of critical code, run by deliver_pending() (main thread only).
PENDING: list[tuple[Handler, int, FrameType | None]] = []
_MAIN_THREAD = [threading.main_thread()]


def critical(func: F) -> F:
    """Mark ``func`` a critical section: a :func:`signal_safe` handler called while it (or
    anything it calls) runs is deferred until the ledger's enter or exit completes."""
    code = getattr(func, "__func__", func).__code__
    _CRITICAL.add(code)
    return func


@critical  # see signal_safe's guarded: a signal arriving during the walk waits
def in_critical_section(frame: FrameType | None) -> bool:
    """True if the Python frame ``frame`` (a signal handler's second argument), or one of
    its callers, runs speedflags' critical code."""
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
    calls after it stay queued for the next delivery.

    Every way out of critical code ends in the drain, the loop around this call (the
    module's docstring).
    """
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
    def guarded(signum: int, frame: FrameType | None) -> Any:
        if in_critical_section(frame):
            PENDING.append((handler, signum, frame))  # the ledger runs it once done
            return None
        return handler(signum, frame)

    # A signal arriving while this runs (a fast timer) waits too: were it to raise in here,
    # it would come out where this call was deciding to wait.
    critical(guarded)
    return guarded
