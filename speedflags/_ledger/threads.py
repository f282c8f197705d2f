"""The threads that opened frames, a part of :class:`~speedflags.FlagLedger`
(:class:`Threads`, ``ledger.threads``): who they are, which of them ended, and what a
``fork`` leaves of them; and the refusals that depend on the calling thread (a signal
handler re-entering the ledger, a frame closed from another thread).

A thread that ends inside a block leaves its frames open with no one to exit them: the
next boundary (any block entered or exited, in any thread) restores their process-wide
levers (:func:`~.unwind.abandon`). The contract: ``docs/architecture.md`` ("The ledger's
invariants", "Interrupts, signals and fork").
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

from .._short_repr import short_repr
from .._tracing import Where
from ..errors import LedgerOrderError, LedgerReentryError
from .frame import Frame
from .interrupts import forked
from .notices import Notice
from .own_writes import _WRITING
from .ring import Ring
from .stacks import Stacks
from .unwind import abandon

_get_ident = threading.get_ident
_current_thread = threading.current_thread
# One list per thread: the sentinels that tell each ledger the thread has ended.
_THREAD_ENDS = threading.local()


class Known(NamedTuple):
    """What the ledger knows of a thread that opened a frame (the hot path reads it by
    index: ``known[0]``, ``known[1]``)."""

    token: int  # its token: reported when the thread ends
    thread: threading.Thread  # whose name each frame records


class _ThreadEnd:
    """Lives in a thread's thread-local storage; freed when the thread ends, it tells the
    ledger, whose next boundary restores the frames the thread left open."""

    __slots__ = ("gone", "known", "tid", "token")

    def __init__(self, gone: list[int], known: dict[int, Known], tid: int, token: int) -> None:
        self.gone = gone
        self.known = known
        self.tid = tid
        self.token = token

    def __del__(self) -> None:
        known = self.known.get(self.tid)
        if known is not None and known[0] == self.token:
            self.known.pop(self.tid, None)
        self.gone.append(self.token)  # read under the ledger's lock at the next boundary


class Threads:
    """A part of :class:`~speedflags.FlagLedger`: the threads that opened frames.

    Its own state: ``known`` (the ident of each thread that opened a frame -> its
    :class:`Known`: token and ``threading.Thread``) and ``gone`` (the tokens of those that
    ended: their frames are abandoned, and restored at the next boundary).

    Example:
        >>> import threading
        >>> from speedflags._ledger.ring import Ring
        >>> from speedflags._ledger.stacks import Stacks
        >>> from speedflags._ledger.threads import Threads
        >>> lock = threading.RLock()
        >>> threads = Threads(lock, Stacks(lock), Ring(16))
        >>> threads.drop_abandoned(None)  # no thread that opened a frame has ended
        []
    """

    __slots__ = ("__weakref__", "gone", "known", "lock", "ring", "stacks", "tokens")

    def __init__(self, lock: Any, stacks: Stacks, ring: Ring):
        self.lock = lock
        self.stacks = stacks
        self.ring = ring
        self.known: dict[int, Known] = {}
        self.gone: list[int] = []
        self.tokens: Iterator[int] = itertools.count(1)
        THREADS.add(self)

    # --- re-entry and refusals --------------------------------------------------------------

    def reentered(self, label: str) -> None:
        """Refuse an enter or exit made while this thread is inside the ledger (a signal
        handler), or clear the mark an interrupted exit left behind."""
        if self.lock._is_owned():
            raise LedgerReentryError(
                f"{short_repr(label)} was entered or exited while this thread was inside "
                "speedflags' ledger, entering or exiting another block: only code that "
                "interrupts the thread (a signal handler) can do that, and the block cannot "
                "nest there. "
                "Nothing was changed. Wrap the handler with speedflags.signal_safe(handler): "
                "it then runs just after the ledger returns, where its block nests normally."
            )
        _WRITING.discard(_get_ident())  # a mark an interrupted exit left behind: not inside

    def not_closable(self, frame: Frame) -> LedgerOrderError:
        """Why ``frame`` cannot be closed here: closed already, or another thread's."""
        if frame.closed:
            return LedgerOrderError(
                f"frame {short_repr(frame.label)} (entered at {frame.where}) is already closed"
            )
        return LedgerOrderError(
            f"frame {short_repr(frame.label)} was entered in thread {short_repr(frame.thread)} and "
            f"cannot be exited from thread {short_repr(_current_thread().name)}; nothing was "
            f"restored. It stays open for thread {short_repr(frame.thread)} to exit; if that "
            "thread ends first, its process-wide levers are restored at the next speedflags "
            "boundary"
        )

    # --- threads that ended ---------------------------------------------------------------

    def thread_token(self, tid: int) -> Known:
        """A new token for the calling thread ``tid`` (its end is reported to this ledger),
        and its ``threading.Thread``."""
        token = int(next(self.tokens))
        ends = getattr(_THREAD_ENDS, "ends", None)
        if ends is None:
            ends = _THREAD_ENDS.ends = []
        ends.append(_ThreadEnd(self.gone, self.known, tid, token))
        known = self.known[tid] = Known(token, _current_thread())
        return known

    def drop_abandoned(self, where: Where) -> list[Notice]:
        """Under the lock: restore the frames of threads that ended (or, after a fork, that
        do not exist in this process). Interrupted, it runs again next time: frames already
        dropped are closed and skipped."""
        count = len(self.gone)
        gone = set(self.gone[:count])
        notices = [
            abandon(self.stacks, self.ring, frame, where)
            for frame in reversed(list(self.stacks.open.values()))
            if frame.token in gone and not frame.closed
        ]
        del self.gone[:count]
        return notices

    # --- fork ----------------------------------------------------------------------------

    def forked(self) -> None:
        """In the child, right after ``os.fork()``: only the forking thread exists. The lock
        was held across the fork by the forking thread (no section is half-way through);
        free it, and mark every other thread's frames abandoned, for the next boundary."""
        self.lock._at_fork_reinit()
        _WRITING.clear()
        tid = _get_ident()
        self.gone.extend(known[0] for t, known in list(self.known.items()) if t != tid)
        known = self.known.get(tid)
        self.known.clear()
        if known is not None:
            self.known[tid] = known


# --- fork -----------------------------------------------------------------------------------

THREADS: weakref.WeakSet[Threads] = weakref.WeakSet()  # one per FlagLedger made


def _before_fork() -> None:
    # No thread may be half-way through an enter or exit when the process is copied: hold
    # every ledger's lock across the fork (the forking thread waits for the others' sections).
    for part in list(THREADS):
        part.lock.acquire()


def _after_fork_in_parent() -> None:
    for part in list(THREADS):
        part.lock.release()


def _after_fork_in_child() -> None:
    forked()
    for part in list(THREADS):
        part.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
