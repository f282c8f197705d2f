"""The ledger when something interrupts it: exits that must complete, threads that ended,
forks, and re-entry from a signal handler.

:class:`Recovery` is the ledger's part for these; its own state is which threads opened
frames and which of them ended. Each method is idempotent where an interruption can make it
run twice: it looks at the state (stacks, open frames, the history's last entry) rather than
trusting a step counter. Callers interrupted around an enter or an exit are handled in
:mod:`.entering`. The contract and what is not covered are in ``docs/architecture.md``
("Interrupts, signals and fork").
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .._short_repr import short_repr
from ..errors import AbandonedFrameWarning, LedgerOrderError, LedgerReentryError
from . import own_writes as _own_writes
from .frame import Frame
from .history import Where
from .interrupts import forked
from .notices import Failure, Notice
from .own_writes import _WRITING
from .rare_paths import RarePaths
from .ring import Outcome, Ring
from .stacks import Stacks

_get_ident = threading.get_ident
_current_thread = threading.current_thread
# One list per thread: the sentinels that tell each ledger the thread has ended.
_THREAD_ENDS = threading.local()
# What the ledger knows of a thread that opened a frame: its token, its threading.Thread
Known = tuple[int, threading.Thread]


class _ThreadEnd:
    """Lives in a thread's thread-local storage; freed when the thread ends, it tells the
    ledger, whose next boundary restores the frames the thread left open."""

    __slots__ = ("gone", "threads", "tid", "token")

    def __init__(self, gone: list[int], threads: dict[int, Known], tid: int, token: int) -> None:
        self.gone = gone
        self.threads = threads
        self.tid = tid
        self.token = token

    def __del__(self) -> None:
        known = self.threads.get(self.tid)
        if known is not None and known[0] == self.token:
            self.threads.pop(self.tid, None)
        self.gone.append(self.token)  # read under the ledger's lock at the next boundary


class Recovery:
    """A part of :class:`~speedflags.FlagLedger`: finishing exits that were interrupted,
    restoring the frames of threads that ended, and the ledger's state after a fork.

    Its own state: ``threads`` (the ident of each thread that opened a frame -> its token,
    and its ``threading.Thread``, whose name each frame records)
    and ``gone`` (the tokens of those that ended: their frames are abandoned, and restored
    at the next boundary).

    Example:
        >>> import threading
        >>> from speedflags._ledger.rare_paths import RarePaths
        >>> from speedflags._ledger.recovery import Recovery
        >>> from speedflags._ledger.ring import Ring
        >>> from speedflags._ledger.stacks import Stacks
        >>> lock, ring = threading.RLock(), Ring(16)
        >>> stacks = Stacks(lock)
        >>> recovery = Recovery(lock, stacks, ring, RarePaths(stacks, ring))
        >>> recovery.drop_abandoned(None)  # no thread that opened a frame has ended
        []
    """

    __slots__ = (
        "__weakref__", "gone", "lock", "rare_paths", "ring", "stacks", "threads", "tokens"
    )  # fmt: skip

    def __init__(self, lock: Any, stacks: Stacks, ring: Ring, rare_paths: RarePaths):
        self.lock = lock
        self.stacks = stacks
        self.ring = ring
        self.rare_paths = rare_paths
        self.threads: dict[int, Known] = {}
        self.gone: list[int] = []
        self.tokens: Iterator[int] = itertools.count(1)
        RECOVERIES.add(self)

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

    # --- exits that must complete ---------------------------------------------------------

    def restore_again(
        self,
        frame: Frame,
        i: int,
        exc: BaseException,
        where: Where,
        found: list[Any],
        restored: list[Any],
        notes: list[str] | None,
        failures: list[Failure] | None,
        pending: BaseException | None,
    ) -> tuple[list[str], list[Failure], BaseException | None]:
        """Lever ``i``'s restore raised ``exc``: try once more, from what the state and the
        stacks say now. An exception that interrupted the restore (Ctrl-C) does not recur,
        and the exit then raises it once complete; a real failure fails again and is
        reported. Returns the notes, the failures and the interruption the exit raises once
        done (the lists made on first use)."""
        notes = notes if notes is not None else [""] * frame.applied
        failures = failures if failures is not None else []
        lever = frame.program.levers[i]
        if found[i] is None:  # interrupted before its state was read: nothing written yet
            found[i] = lever.read()
        try:
            restored[i] = self.rare_paths.finish_lever(frame, i, where, [])
        except BaseException as again:
            self.stacks.unlink(frame, i)  # no stale entry is left on its stack
            # interrupted again (a plain handler): the interruption is what the exit raises,
            # not what the first try ran into (an entry an earlier exit had taken off)
            failed = exc if isinstance(again, Exception) else again
            failures.append((i, failed))
            notes[i] = f"failed: {type(failed).__name__}: {failed}"
            restored[i] = lever.read()
            return notes, failures, pending
        notes[i] = f"restored again after {type(exc).__name__}"
        if isinstance(exc, LookupError):
            # its stack entry was gone: an earlier exit of this frame, interrupted twice,
            # had finished this lever already. Nothing to report.
            return notes, failures, pending
        return notes, failures, pending or exc

    def finish_close(self, frame: Frame, where: Where, outcome: Outcome, watched: Any) -> None:
        """An exception interrupted a close outside its per-lever loop: complete the exit
        (``outcome``: what the close had done)."""
        found, restored, _ = outcome
        levers = frame.program.levers
        for i in range(len(found) - 1, -1, -1):
            if found[i] is None:  # not reached by close(): what it finds is what was found
                found[i] = levers[i].read()
            if self.stacks.on_a_stack(frame, i):
                try:
                    restored[i] = self.rare_paths.finish_lever(frame, i, where, [])
                except Exception:
                    self.stacks.unlink(frame, i)
            # closed already (nothing to restore): what it reads now; a plain statement last,
            # not an `if` (tests/test_exception_table_holes.py)
            restored[i] = levers[i].read() if restored[i] is None else restored[i]
        frame.closed = True
        frame.task = None
        self.stacks.open.pop(frame.id, None)
        # the close may have recorded it before the interruption (checked here, off its hot
        # path)
        if not self.ring.closed_last(frame):
            self.ring.closed(frame, where, outcome)
        _own_writes.leave(watched)

    # --- threads that ended ---------------------------------------------------------------

    def thread_token(self, tid: int) -> Known:
        """A new token for the calling thread ``tid`` (its end is reported to this ledger),
        and its ``threading.Thread``."""
        token = int(next(self.tokens))
        ends = getattr(_THREAD_ENDS, "ends", None)
        if ends is None:
            ends = _THREAD_ENDS.ends = []
        ends.append(_ThreadEnd(self.gone, self.threads, tid, token))
        known = self.threads[tid] = (token, _current_thread())
        return known

    def drop_abandoned(self, where: Where) -> list[Notice]:
        """Under the lock: restore the frames of threads that ended (or, after a fork, that
        do not exist in this process). Interrupted, it runs again next time: frames already
        dropped are closed and skipped."""
        count = len(self.gone)
        gone = set(self.gone[:count])
        notices = [
            self._abandon(frame, where)
            for frame in reversed(list(self.stacks.open.values()))
            if frame.token in gone and not frame.closed
        ]
        del self.gone[:count]
        return notices

    def _abandon(self, frame: Frame, where: Where) -> Notice:
        program = frame.program
        n = frame.applied
        found: list[Any] = [None] * n
        restored: list[Any] = [None] * n
        notes = [""] * n
        for i in range(n - 1, -1, -1):
            lever = program.levers[i]
            if program.keys[i] is None:  # thread-local: it ended with its thread
                self.stacks.unlink(frame, i)
                notes[i] = "abandoned: thread-local state, ended with its thread"
                continue
            try:
                found[i] = lever.read()
                restored[i] = self.rare_paths.finish_lever(frame, i, where, [])
                notes[i] = f"abandoned: thread {short_repr(frame.thread)} ended inside the block"
            except Exception as exc:
                self.stacks.unlink(frame, i)
                notes[i] = f"failed: {type(exc).__name__}: {exc}"
        frame.closed = True
        frame.task = None
        self.stacks.open.pop(frame.id, None)
        self.ring.closed(frame, where, (found, restored, notes))
        shared = [program.levers[i].name for i in range(n) if program.keys[i] is not None]
        message = (
            f"{short_repr(frame.label)} (entered at {frame.where} in thread "
            f"{short_repr(frame.thread)}) was still open when thread {short_repr(frame.thread)} "
            "ended (or, after a fork, does not exist "
            f"in this process); no thread can exit it, so its process-wide levers were "
            f"restored here: {', '.join(shared) or 'none'}."
        )
        return ("abandoned", frame.label, frame.where, frame.thread), message, AbandonedFrameWarning

    # --- fork ----------------------------------------------------------------------------

    def forked(self) -> None:
        """In the child, right after ``os.fork()``: only the forking thread exists. The lock
        was held across the fork by the forking thread (no section is half-way through);
        free it, and mark every other thread's frames abandoned, for the next boundary."""
        self.lock._at_fork_reinit()
        _WRITING.clear()
        tid = _get_ident()
        self.gone.extend(known[0] for t, known in list(self.threads.items()) if t != tid)
        known = self.threads.get(tid)
        self.threads.clear()
        if known is not None:
            self.threads[tid] = known


# --- fork -----------------------------------------------------------------------------------

RECOVERIES: weakref.WeakSet[Recovery] = weakref.WeakSet()  # one per FlagLedger made


def _before_fork() -> None:
    # No thread may be half-way through an enter or exit when the process is copied: hold
    # every ledger's lock across the fork (the forking thread waits for the others' sections).
    for part in list(RECOVERIES):
        part.lock.acquire()


def _after_fork_in_parent() -> None:
    for part in list(RECOVERIES):
        part.lock.release()


def _after_fork_in_child() -> None:
    forked()
    for part in list(RECOVERIES):
        part.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
