"""The FlagLedger: every lever change goes through here, is recorded, and is undone exactly.

The ledger knows levers only through the :class:`~speedflags.levers._base.Lever` protocol;
what it runs is a :class:`~speedflags.flag_ledger.program.Program` per frame, and what it
records goes into a ring of compact entries (:mod:`speedflags.flag_ledger.history`).

Stacks. For each piece of torch state (a lever *domain*) the ledger keeps a stack of the
open frames that set it, each with the state it found. Process-wide domains have one stack;
thread-local ones (autocast) one per thread. Closing the top entry restores the state it
found. Closing an entry below others (a frame of another thread that exits first, or an
out-of-order exit) restores the state it found and then re-applies the entries above it, so
every frame still open keeps what it asked for and the base state comes back once the last
one exits.

Contexts. Which frames are open, and in which order they must exit, is kept per
``contextvars`` context: each thread, and each asyncio task, has its own tuple of open
frames (a task created inside a block starts from a copy, and never changes its parent's).
So tasks that hold blocks across ``await`` may exit in any order; within one context an
out-of-order exit is still an error. A frame that sets a shared flag (a process-wide lever,
or autocast for the tasks of one thread) to a value other than an open frame of another
thread or task has set warns (:class:`~speedflags.LeverConflictWarning`). The contract is
in ``docs/threading.md``.
"""

from __future__ import annotations

import itertools
import threading
from asyncio import current_task as _current_task
from asyncio.events import _get_running_loop
from collections import deque
from contextvars import ContextVar
from typing import Any, Deque, Dict, Hashable, List, Optional, Tuple

from .._short_repr import short_repr
from . import history as _history
from . import notices as _notices
from . import own_writes as _own_writes
from .history import SET, FlagRecord, Where, format_where, json_default, now
from .interrupts import PENDING, critical, deliver_pending
from .notices import Failure, Notice
from .own_writes import _WRITING
from .program import Frame, LeverItem, Program, without_closed
from .recovery import LEDGERS, LedgerRecovery

__all__ = [
    "FlagLedger",
    "FlagRecord",
    "Frame",
    "LeverItem",
    "Program",
    "Where",
    "format_where",
    "json_default",
    "ledger",
]

DEFAULT_HISTORY_SIZE = 4096
BURIED_NOTE = "closed under frames entered later; see the records around it"
_get_ident = threading.get_ident
_current_thread = threading.current_thread


class FlagLedger(LedgerRecovery):
    """Applies, records and restores lever changes for a process.

    Use :func:`speedflags.ledger` for the process's ledger: the flags it guards are
    process-wide, so all frames must go through one ledger. Scope: process; its operations
    are thread-safe (one lock), thread-local levers (autocast) are kept per thread, and the
    order in which frames must exit is kept per thread and asyncio task. Closing a frame
    restores each of its levers to the state it found.

    Entering and exiting are safe against exceptions raised in the middle of them (Ctrl-C,
    or any exception a signal handler raises): an enter either completes or is rolled back
    with every flag as before, and an exit completes its restore before letting the
    exception through (``docs/architecture.md``, "Interrupts, signals and fork"). A block
    left open by a thread that ended is restored at the next boundary, and a forked child
    starts with a usable ledger.

    Example:
        >>> import speedflags
        >>> with speedflags.fast_math(cudnn_benchmark=True):
        ...     pass
        >>> [(r.lever, r.action) for r in speedflags.ledger().history[-2:]]
        [('cudnn_benchmark', 'set'), ('cudnn_benchmark', 'restore')]

    Args:
        history_size: how many recent records ``history`` keeps (a ring: a training loop
            that enters a frame every step must not grow memory).
    """

    def __init__(self, history_size: int = DEFAULT_HISTORY_SIZE) -> None:
        if type(history_size) is not int or history_size <= 0:  # not a bool either
            raise ValueError(f"history_size={short_repr(history_size)}: expected a positive int")
        self._history_size = history_size
        # Taken with `with`, which CPython enters without an interrupt check between the
        # acquire and the block, so no exception can leave it held. Reentrant, so that a
        # signal handler entering a block while its thread holds it is refused with an error
        # (LedgerReentryError) instead of waiting forever for itself.
        self._lock = threading.RLock()
        # domain -> [(frame, index)] (process scope); (domain, thread id) -> ... (thread scope)
        self._stacks: Dict[Hashable, List[Tuple[Frame, int]]] = {}
        # every open frame, of every thread and context, by id (so in order of entry)
        self._open: Dict[int, Frame] = {}
        # the open frames of the current context (thread or asyncio task), innermost last,
        # and on top of them maybe frames closed since (skipped; dropped by the next open):
        # an immutable tuple, set anew by open(), so a task created inside a block inherits
        # a snapshot and never shares mutation with its parent
        self._frames: ContextVar[Tuple[Frame, ...]] = ContextVar(
            f"speedflags_frames_{id(self):x}", default=()
        )
        # Each entry holds one or more records, so the ring never needs more entries than
        # records kept.
        self._history: Deque[tuple[Any, ...]] = deque(maxlen=history_size)
        self._seq = 0
        # the id of the last frame opened: a caller interrupted right after open() returned
        # finds the frame it opened by it (cancel_open)
        self._last_id = 0
        # threads that opened frames (ident -> token), and the tokens of those that ended:
        # their frames are abandoned, and restored at the next boundary (_drop_abandoned)
        self._threads: Dict[int, int] = {}
        self._gone: List[int] = []
        self._tokens = itertools.count(1)
        LEDGERS.add(self)

    # --- frames: the hot path --------------------------------------------------------------

    @critical
    def open(
        self,
        program: Program,
        label: str,
        where: Where = None,
        owner: object = None,
        device: Optional[str] = None,
    ) -> Frame:
        """Apply ``program``'s levers as one frame and return the frame.

        All levers' states are read and checked first (a mixed TF32 state is refused before
        anything changes); then, in order, each is written and pushed on its domain's stack.
        If anything fails or is interrupted before the frame is complete, every lever already
        applied is restored before the error propagates: the frame is opened whole or not at
        all. A :class:`~speedflags.LeverConflictWarning` (another thread's or task's open
        frame set a shared flag differently) is emitted once the frame is open and the lock
        released; if it raises (warnings as errors), the frame is closed again first.

        Raises:
            LedgerReentryError: this thread is inside the ledger already (a signal handler
                entered a block while its thread was entering or exiting one).
        """
        tid = _get_ident()
        if tid in _WRITING:
            self._reentered(label)
        token = self._threads.get(tid)
        if token is None:
            token = self._thread_token(tid)
        loop = _get_running_loop()
        task = None if loop is None else _current_task(loop)  # type: ignore[redundant-expr, unused-ignore]
        frame = Frame(
            label, owner, where, device, program, tid, _current_thread().name,
            task, _history.rank_source(), token,
        )  # fmt: skip
        befores = frame.befores
        afters = frame.afters
        stacks = self._stacks
        crowded = False  # a stack held entries already: look for conflicts
        notices: Optional[List[Notice]] = None
        context = self._frames
        try:
            with self._lock:
                _WRITING.add(tid)
                watched = None
                try:
                    if self._gone:
                        notices = self._drop_abandoned(where)
                    # speedflags.watch(): a boundary where changes made around Python are found
                    if _own_writes.WATCHER is not None:
                        watched = _own_writes.enter(self, label, where)
                    self._last_id = fid = frame.id = self._last_id + 1
                    seen = program.seen
                    for i, lever, check in program.reads:
                        state = lever.read()
                        # The same state as last time: pass on the object read then. Levers key
                        # caches on states (the TF32 family's write plans); an object seen before
                        # hashes and compares by identity, a fresh one of 12 strings costs ~0.5 µs.
                        last = seen[i]
                        if state == last:
                            state = last
                        else:
                            seen[i] = state
                        befores[i] = state
                        if not check:  # not `if check:` last: a hole on Python 3.13 (see
                            continue  # tests/test_exception_table_holes.py)
                        lever.check(state)  # may refuse: nothing has changed yet
                    for i, lever, value, p, key, domain in program.rows:
                        before = befores[i] = befores[i] if p < 0 else afters[p]
                        if key is None:
                            key = (domain, tid)
                        stack = stacks.get(key)
                        if stack is None:
                            stack = self._new_stack(key)
                        elif stack:
                            crowded = True
                        # Counted, then pushed, then written: a roll-back after any of the three
                        # restores (a no-op before the write), and unlinks what was pushed.
                        frame.applied = i + 1
                        stack.append((frame, i))
                        afters[i] = lever.apply(value, before)
                    n = program.n
                    self._seq = seq = self._seq + n
                    self._history.append(
                        (SET, seq - n + 1, now(), label, fid, frame.thread, frame.rank, where,
                         program.lever_keys, program.reasons, tuple(befores), tuple(afters))
                    )  # fmt: skip
                    if program.skipped:
                        self._skips(frame, where)
                    self._open[fid] = frame
                    if crowded:
                        conflicts = self._conflicts(frame)
                        if conflicts:
                            notices = conflicts if notices is None else notices + conflicts
                    frames = context.get()
                    if frames and frames[-1].closed:  # the common case: close() left one there
                        frames = frames[:-1]
                        if frames and frames[-1].closed:
                            frames = without_closed(frames)
                    context.set(frames + (frame,))  # noqa: RUF005
                    if watched is not None:
                        watched.__exit__(None, None, None)
                except BaseException as exc:  # a failure, or an exception that interrupted us
                    error = self._abort_open(frame, exc, where, watched)
                    if error is not None:
                        raise error  # noqa: B904 - its cause is set
                    raise
                finally:
                    _WRITING.discard(tid)
        except BaseException:  # refused, failed or interrupted: rolled back, lock released
            # signal_safe handlers deferred while entering run now: an interrupt reaches the
            # program on the refusal's way out (or instead of it)
            while True:  # no check point after the last test: see deliver_pending
                if not PENDING:
                    break
                deliver_pending()
            raise
        if not (notices or PENDING):  # no jump taken on the way out (see deliver_pending)
            return frame
        try:
            if notices:
                _notices.speak(notices)
            while True:  # no check point after the last test: see deliver_pending
                if not PENDING:
                    break
                deliver_pending()
        except BaseException:  # a warning turned into an error, or a handler's exception:
            self.close(frame, where)  # nothing stays entered
            raise
        return frame

    @critical
    def close_innermost(self, owner: object, where: Where = None) -> None:
        """``close(innermost(owner), where)``: what a ``with`` block's exit does."""
        frames = self._frames.get()
        if frames:
            frame = frames[-1]
            if frame.owner is owner and not frame.closed:
                return self.close(frame, where)
        return self.close(self.innermost(owner), where)

    @critical
    def close(self, frame: Frame, where: Where = None) -> None:
        """Restore every lever of ``frame`` (in reverse order, trying each one) and close it.

        Every lever is restored first; warnings (drift) and errors come after, once the
        frame is off every stack and the ledger's lock is released. An exception that
        interrupts the exit (Ctrl-C) is raised once the exit is complete.

        Raises:
            LedgerOrderError: the frame is closed already, belongs to another thread, or is
                not the innermost open frame of this thread (or asyncio task). In the last
                case the frame is still closed correctly (frames opened after it keep their
                levers) before raising.
            RestoreError: several levers could not be restored; its message names those
                restored and those not (with what they read now). A single failure is
                raised as itself.
            LedgerReentryError: this thread is inside the ledger already (a signal handler).
        """
        tid = _get_ident()
        if tid in _WRITING:
            self._reentered(frame.label)
        failures: Optional[List[Failure]] = None
        notices: Optional[List[Notice]] = None
        pending: Optional[BaseException] = None  # an interruption, raised once the exit is done
        with self._lock:
            if frame.closed or frame.thread_id != tid:
                raise self._not_closable(frame)
            _WRITING.add(tid)
            watched = None
            program = frame.program
            n = frame.applied
            found: List[Any] = [None] * n
            restored: List[Any] = [None] * n
            notes: Optional[List[str]] = None
            try:
                if self._gone:
                    notices = self._drop_abandoned(where)
                if _own_writes.WATCHER is not None:
                    watched = _own_writes.enter(self, frame.label, where)
                befores = frame.befores
                afters = frame.afters
                stacks = self._stacks
                rows = program.rows
                for k in range(n - 1, -1, -1):
                    i, lever, _, _, key, domain = rows[k]
                    try:
                        if key is None:
                            key = (domain, tid)
                        stack = stacks[key]
                        top = stack[-1]
                        current = lever.read()
                        after = afters[i]
                        if current == after:
                            current = after  # the object the lever returned: cheap in its caches
                        found[i] = current
                        if top[0] is frame and top[1] == i:
                            stack.pop()  # an emptied stack stays for the next frame (_new_stack)
                            before = befores[i]
                            restored[i] = (
                                lever.restore(before, current) if current != before else current
                            )
                            if current is not after:
                                if notes is None:
                                    notes = [""] * n
                                if notices is None:
                                    notices = []
                                notes[i], notice = _notices.drift(
                                    lever, current, after, before, frame
                                )
                                notices.append(notice)
                        else:  # under later frames (or off its stack: an interrupted exit's)
                            if notices is None:
                                notices = []
                            restored[i] = self._finish_lever(frame, i, where, notices)
                            if notes is None:
                                notes = [""] * n
                            notes[i] = (
                                "closed under frames entered later; see the records around it"
                            )
                    except BaseException as exc:  # every lever is restored even if one fails
                        if notes is None:
                            notes = [""] * n
                        if failures is None:
                            failures = []
                        pending = self._restore_again(frame, i, exc, where, found, restored,
                                                      notes, failures, pending)  # fmt: skip
                frame.closed = True
                frame.task = None  # a frame kept by the caller must not keep its task alive
                self._open.pop(frame.id, None)
                self._record_close(frame, where, found, restored, notes)
                if watched is not None:
                    watched.__exit__(None, None, None)
            except BaseException as exc:  # interrupted in the bookkeeping: finish it first
                self._finish_close(frame, where, found, restored, notes, watched)
                pending = pending or exc
            finally:
                _WRITING.discard(tid)
        # This context's innermost frame, past those closed already. If it is ``frame``,
        # ``frame`` stays in the tuple, closed, until the next open() drops it: one
        # ContextVar.set per frame instead of two (each allocates; ~0.2 µs a frame).
        frames = self._frames.get()
        k = len(frames) - 1
        while k >= 0 and frames[k] is not frame and frames[k].closed:
            k -= 1
        innermost: Optional[Frame] = None
        if k < 0 or frames[k] is not frame:
            innermost = self._leave_context(frames, frame)
        try:
            if notices or failures or innermost is not None or pending is not None:
                error = _notices.close_error(frame, innermost, failures or (), restored)
                _notices.speak(notices, pending or error)
        finally:  # signal_safe handlers that came while exiting
            while True:  # no check point after the last test: see deliver_pending
                if not PENDING:
                    break
                deliver_pending()


_PROCESS_LEDGER = FlagLedger()


def ledger() -> FlagLedger:
    """The process's :class:`FlagLedger` (all speedflags frames go through it).

    Scope: process. Reading it changes nothing.

    Example:
        >>> import speedflags
        >>> speedflags.ledger() is speedflags.ledger()
        True
    """
    return _PROCESS_LEDGER
