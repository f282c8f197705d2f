"""The ledger when something interrupts it: exits that must complete, threads that ended,
forks, re-entry from a signal handler, and callers interrupted around an enter or an exit.

Each method is idempotent where an interruption can make it run twice: it looks at the
state (stacks, open frames, the history's last entry) rather than trusting a step counter.
The contract and what is not covered are in ``docs/architecture.md`` ("Interrupts, signals
and fork").
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._short_repr import short_repr
from ..errors import AbandonedFrameWarning, LedgerOrderError, LedgerReentryError
from . import own_writes as _own_writes
from .history import RESTORE, Where, now
from .interrupts import PENDING, critical, deliver_pending, forked
from .notices import Failure, Notice
from .own_writes import _WRITING
from .paths import LedgerPaths
from .program import Frame

_get_ident = threading.get_ident
_current_thread = threading.current_thread
# One list per thread: the sentinels that tell each ledger the thread has ended.
_THREAD_ENDS = threading.local()


class _ThreadEnd:
    """Lives in a thread's thread-local storage; freed when the thread ends, it tells the
    ledger, whose next boundary restores the frames the thread left open."""

    __slots__ = ("gone", "threads", "tid", "token")

    def __init__(self, gone: List[int], threads: Dict[int, int], tid: int, token: int) -> None:
        self.gone = gone
        self.threads = threads
        self.tid = tid
        self.token = token

    def __del__(self) -> None:
        if self.threads.get(self.tid) == self.token:
            self.threads.pop(self.tid, None)
        self.gone.append(self.token)  # read under the ledger's lock at the next boundary


class LedgerRecovery(LedgerPaths):
    """:class:`~speedflags.flag_ledger.ledger.FlagLedger` when interrupted (a base class of it)."""

    _lock: Any  # a threading.RLock (its type is private to the threading module)
    _last_id: int
    _threads: Dict[int, int]
    _gone: List[int]
    _tokens: Any

    # --- callers interrupted around an enter or an exit -----------------------------------

    @critical
    def cancel_open(self, owner: object, mark: int, where: Where = None) -> None:
        """Close the frame this context opened for ``owner`` after frame id ``mark``, if any.

        What a caller runs when an exception interrupts it between a successful
        :meth:`open` and its own return: ``mark`` is ``ledger._last_id`` read before the call.
        A :func:`~speedflags.signal_safe` handler deferred in here (or by the failed open
        before it) runs before it returns.
        """
        try:
            frames = self._frames.get()
            if frames:
                frame = frames[-1]
                if frame.owner is owner and frame.id > mark and not frame.closed:
                    self.close(frame, where)
        finally:
            while True:  # no check point after the last test: see deliver_pending
                if not PENDING:
                    break
                deliver_pending()

    @critical
    def finish_exit(self, owner: object, where: Where = None) -> None:
        """Close ``owner``'s innermost frame in this context if its exit never started.

        What ``__exit__`` runs when an exception (not the ledger's own error) interrupted it
        before the ledger closed the frame. A frame of ``owner`` found closed first means the
        exit did happen. (A spec nested directly in itself, whose outer exit is interrupted
        before it starts, is left open: its inner frame, closed, is found first.)
        """
        try:
            frame = _last_of(self._frames.get(), owner)
            if frame is not None and not frame.closed:
                self.close(frame, where)
        finally:
            while True:  # no check point after the last test: see deliver_pending
                if not PENDING:
                    break
                deliver_pending()

    def close(self, frame: Frame, where: Where = None) -> None:  # pragma: no cover
        raise NotImplementedError  # FlagLedger's

    # --- re-entry ----------------------------------------------------------------------

    def _reentered(self, label: str) -> None:
        if self._lock._is_owned():
            raise LedgerReentryError(
                f"{short_repr(label)} was entered or exited while this thread was inside "
                "speedflags' ledger, entering or exiting another block: only code that "
                "interrupts the thread (a signal handler) can do that, and the block cannot "
                "nest there. "
                "Nothing was changed. Wrap the handler with speedflags.signal_safe(handler): "
                "it then runs just after the ledger returns, where its block nests normally."
            )
        _WRITING.discard(_get_ident())  # a mark an interrupted exit left behind: not inside

    # --- exits that must complete ---------------------------------------------------------

    def _not_closable(self, frame: Frame) -> LedgerOrderError:
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

    def _restore_again(
        self,
        frame: Frame,
        i: int,
        exc: BaseException,
        where: Where,
        found: List[Any],
        restored: List[Any],
        notes: List[str],
        failures: List[Failure],
        pending: Optional[BaseException],
    ) -> Optional[BaseException]:
        # Lever i's restore raised. Try once more, from what the state and the stacks say
        # now: an exception that interrupted the restore (Ctrl-C) does not recur, and the
        # exit then raises it once complete; a real failure fails again and is reported.
        lever = frame.program.levers[i]
        if found[i] is None:  # interrupted before its state was read: nothing written yet
            found[i] = lever.read()
        try:
            restored[i] = self._finish_lever(frame, i, where, [])
        except BaseException as again:
            self._unlink(frame, i)  # no stale entry is left on its stack
            # interrupted again (a plain handler): the interruption is what the exit raises,
            # not what the first try ran into (an entry an earlier exit had taken off)
            failed = exc if isinstance(again, Exception) else again
            failures.append((i, failed))
            notes[i] = f"failed: {type(failed).__name__}: {failed}"
            restored[i] = lever.read()
            return pending
        notes[i] = f"restored again after {type(exc).__name__}"
        if isinstance(exc, LookupError):
            # its stack entry was gone: an earlier exit of this frame, interrupted twice,
            # had finished this lever already. Nothing to report.
            return pending
        return pending or exc

    def _finish_lever(self, frame: Frame, i: int, where: Where, notices: List[Notice]) -> Any:
        # Bring lever i of ``frame`` back, whatever part of its exit already ran: off its
        # stack, and the state what the stack says should hold now.
        lever = frame.program.levers[i]
        stack = self._stacks.get(frame.key(i)) or []
        self._drop_stale(stack, frame)
        position = next((j for j, (f, k) in enumerate(stack) if f is frame and k == i), None)
        current = lever.read()
        if position is not None and position < len(stack) - 1:
            return self._close_buried(frame, i, current, where, notices)
        if position is not None:
            stack.pop()
        if stack:  # its entry is gone already, under others: what the top asked for holds
            top, j = stack[-1]  # (another lever of the domain, maybe: tf32 under precision)
            return top.program.levers[j].apply(top.program.values[j], current)
        before = frame.befores[i]
        return lever.restore(before, current) if current != before else current

    def _record_close(
        self,
        frame: Frame,
        where: Where,
        found: List[Any],
        restored: List[Any],
        notes: Optional[List[str]],
    ) -> None:
        n = len(found)
        self._seq = seq = self._seq + n
        self._history.append(
            (RESTORE, seq - n + 1, now(), frame.label, frame.id, frame.thread, frame.rank,
             where, frame.program.lever_keys[:n], tuple(notes) if notes else None,
             tuple(found), tuple(restored))
        )  # fmt: skip

    def _finish_close(
        self,
        frame: Frame,
        where: Where,
        found: List[Any],
        restored: List[Any],
        notes: Optional[List[str]],
        watched: Any,
    ) -> None:
        # An exception interrupted close() outside its per-lever loop: complete the exit.
        levers = frame.program.levers
        for i in range(len(found) - 1, -1, -1):
            if found[i] is None:  # not reached by close(): what it finds is what was found
                found[i] = levers[i].read()
            if self._on_a_stack(frame, i):
                try:
                    restored[i] = self._finish_lever(frame, i, where, [])
                except Exception:
                    self._unlink(frame, i)
            # closed already (nothing to restore): what it reads now; a plain statement last,
            # not an `if` (tests/test_exception_table_holes.py)
            restored[i] = levers[i].read() if restored[i] is None else restored[i]
        frame.closed = True
        frame.task = None
        self._open.pop(frame.id, None)
        last = self._history[-1] if self._history else None
        # close() may have recorded it before the interruption (checked here, off its hot path)
        if last is None or last[0] != RESTORE or last[4] != frame.id:
            self._record_close(frame, where, found, restored, notes)
        _own_writes.leave(watched)

    def _on_a_stack(self, frame: Frame, i: int) -> bool:
        return any(f is frame and k == i for f, k in self._stacks.get(frame.key(i)) or ())

    # --- threads that ended ---------------------------------------------------------------

    def _thread_token(self, tid: int) -> int:
        token = int(next(self._tokens))
        ends = getattr(_THREAD_ENDS, "ends", None)
        if ends is None:
            ends = _THREAD_ENDS.ends = []
        ends.append(_ThreadEnd(self._gone, self._threads, tid, token))
        self._threads[tid] = token
        return token

    def _drop_abandoned(self, where: Where) -> List[Notice]:
        # Under the lock: restore the frames of threads that ended (or, after a fork, that do
        # not exist in this process). Interrupted, it runs again next time: frames already
        # dropped are closed and skipped.
        count = len(self._gone)
        gone = set(self._gone[:count])
        notices = [
            self._abandon(frame, where)
            for frame in reversed(list(self._open.values()))
            if frame.token in gone and not frame.closed
        ]
        del self._gone[:count]
        return notices

    def _abandon(self, frame: Frame, where: Where) -> Notice:
        program = frame.program
        n = frame.applied
        found: List[Any] = [None] * n
        restored: List[Any] = [None] * n
        notes = [""] * n
        for i in range(n - 1, -1, -1):
            lever = program.levers[i]
            if program.keys[i] is None:  # thread-local: it ended with its thread
                self._unlink(frame, i)
                notes[i] = "abandoned: thread-local state, ended with its thread"
                continue
            try:
                found[i] = lever.read()
                restored[i] = self._finish_lever(frame, i, where, [])
                notes[i] = f"abandoned: thread {short_repr(frame.thread)} ended inside the block"
            except Exception as exc:
                self._unlink(frame, i)
                notes[i] = f"failed: {type(exc).__name__}: {exc}"
        frame.closed = True
        frame.task = None
        self._open.pop(frame.id, None)
        self._record_close(frame, where, found, restored, notes)
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

    def _forked(self) -> None:
        # In the child, right after os.fork(): only the forking thread exists. The lock was
        # held across the fork by the forking thread (no section is half-way through); free
        # it, and mark every other thread's frames abandoned, for the next boundary.
        reinit: Optional[Callable[[], None]] = getattr(self._lock, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()
        else:  # pragma: no cover - Python without _at_fork_reinit
            self._lock = threading.RLock()
        _WRITING.clear()
        tid = _get_ident()
        self._gone.extend(token for t, token in list(self._threads.items()) if t != tid)
        token = self._threads.get(tid)
        self._threads.clear()
        if token is not None:
            self._threads[tid] = token


# --- fork -----------------------------------------------------------------------------------

LEDGERS: weakref.WeakSet[LedgerRecovery] = weakref.WeakSet()  # every FlagLedger made


def _before_fork() -> None:
    # No thread may be half-way through an enter or exit when the process is copied: hold
    # every ledger's lock across the fork (the forking thread waits for the others' sections).
    for the_ledger in list(LEDGERS):
        the_ledger._lock.acquire()


def _after_fork_in_parent() -> None:
    for the_ledger in list(LEDGERS):
        the_ledger._lock.release()


def _after_fork_in_child() -> None:
    forked()
    for the_ledger in list(LEDGERS):
        the_ledger._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _last_of(frames: Tuple[Frame, ...], owner: object) -> Optional[Frame]:
    # The innermost frame of ``owner``, closed or not. A function of its own: this loop inside
    # finish_exit's try would be a hole in it on Python 3.13 (tests/test_exception_table_holes.py)
    for frame in reversed(frames):
        if frame.owner is owner:
            return frame
    return None
