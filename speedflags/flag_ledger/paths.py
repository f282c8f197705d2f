"""The ledger off its hot path: inspection, rolling back, closing under later frames, conflicts.

:class:`~speedflags.FlagLedger` keeps its hot path (open and close of a frame that is the
innermost of its stacks) in :mod:`.ledger`. What happens when a lever fails, a frame
exits out of order or under another thread's frames, or a frame overrides another thread's
or task's, is here, with the inspection of the history and the open frames. The rare paths
run under the ledger's lock (``_leave_context`` touches only the calling context) and only
*build* warnings and errors: the ledger speaks once the lock is released
(:mod:`speedflags.flag_ledger.notices`).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any, Deque, Dict, Hashable, List, Optional, Tuple

from .._short_repr import short_repr
from ..errors import LedgerOrderError
from . import history as _history
from . import notices as _notices
from . import own_writes as _own_writes
from .history import FlagRecord, Where, expand, one_entry, records, to_json
from .notices import Failure, Notice
from .program import Frame

_get_ident = threading.get_ident
_KEEP_STACKS = 64


class LedgerPaths:
    """:class:`~speedflags.flag_ledger.ledger.FlagLedger` off its hot path (a base class of it)."""

    _lock: threading.Lock
    _stacks: Dict[Hashable, List[Tuple[Frame, int]]]
    _open: Dict[int, Frame]
    _frames: ContextVar[Tuple[Frame, ...]]
    _history: Deque[tuple[Any, ...]]
    _seq: int
    _history_size: int

    # --- inspection ----------------------------------------------------------------------

    @property
    def history(self) -> tuple[FlagRecord, ...]:
        """The most recent records (at most ``history_size``), oldest first (a copy)."""
        with self._lock:
            raw = tuple(self._history)
        return records(raw, self._history_size)

    def clear_history(self) -> None:
        """Forget the recorded history (open frames and their restore data are kept)."""
        with self._lock:
            self._history.clear()

    def to_json(self, indent: Optional[int] = None) -> str:
        """The history as JSON, with the PyTorch and speedflags versions and the process id."""
        return to_json(self.history, indent)

    def note(
        self,
        lever: str,
        action: str,
        reason: str,
        *,
        before: Any = None,
        after: Any = None,
        label: str = "",
        where: Where = None,
    ) -> FlagRecord:
        """Append an event that is not a frame (a heal, a compile fallback) to the history."""
        thread = threading.current_thread().name
        rank = _history.rank_source()
        with self._lock:
            entry = self._one(label, 0, thread, rank, where, lever, action, reason, before, after)
        return expand(entry)[0]

    def __repr__(self) -> str:
        return f"<FlagLedger: {len(self._history)} entries, {len(self.open_frames())} open frames>"

    # --- frames open ---------------------------------------------------------------------

    def open_frames(self) -> tuple[Frame, ...]:
        """Every frame open now, in all threads and tasks, in order of entry."""
        with self._lock:
            return tuple(self._open.values())

    def _forget_frames(self) -> None:
        # For tests that left frames open: drop them everywhere, restoring nothing.
        with self._lock:
            for frame in self._open.values():
                frame.closed = True
            self._open.clear()
            self._stacks.clear()
        self._frames.set(())

    def innermost(self, owner: object) -> Frame:
        """The innermost open frame entered through ``owner`` in this task (or thread)."""
        frames = self._frames.get()
        for frame in reversed(frames):
            if frame.owner is owner and not frame.closed:
                return frame
        elsewhere = self._innermost_elsewhere(owner, _get_ident())
        if elsewhere is not None:
            return elsewhere
        exited = next((f for f in reversed(frames) if f.owner is owner), None)
        if exited is not None:
            raise LedgerOrderError(
                f"{short_repr(owner)} is exited again: its frame {short_repr(exited.label)} "
                f"(entered at {exited.where} in this thread) was exited already; each block "
                "exits once"
            )
        raise LedgerOrderError(
            f"{short_repr(owner)} is exited but has no open frame in this thread: it was not "
            "entered here, or was exited already (each 'with' must exit once, in the thread "
            "that entered it)"
        )

    # --- history -----------------------------------------------------------------------

    def _one(self, *fields: Any) -> tuple[Any, ...]:
        # a single record: fields as history.one_entry's after `seq`; the caller holds the lock
        self._seq += 1
        entry = one_entry(self._seq, *fields)
        self._history.append(entry)
        return entry

    def _frame_one(
        self, frame: Frame, where: Where, i: int, action: str, reason: str, before: Any, after: Any
    ) -> None:
        key = frame.program.lever_keys[i]
        self._one(
            frame.label, frame.id, frame.thread, frame.rank, where, key, action, reason, before,
            after,
        )  # fmt: skip

    def _skips(self, frame: Frame, where: Where) -> None:
        for name, reason in frame.program.skipped:
            self._one(
                frame.label, frame.id, frame.thread, frame.rank, where, name, "skip", reason,
                None, None,
            )  # fmt: skip

    # --- entering ----------------------------------------------------------------------

    def _conflicts(self, frame: Frame) -> List[Notice]:
        # Once applied: the frames of other threads or tasks, still open, whose state for a
        # domain this frame has just replaced with a different one.
        found: List[Notice] = []
        program = frame.program
        for i in range(program.n):
            if i in program.prev:  # a later lever of this frame sets the same domain
                continue
            theirs: Dict[int, Tuple[Frame, int]] = {}
            for other, j in self._stacks[frame.key(i)]:
                if other is frame:
                    break
                if other.thread_id != frame.thread_id or other.task is not frame.task:
                    theirs[other.id] = (other, j)  # its last lever of the domain counts
            for other, j in theirs.values():
                if other.afters[j] != frame.afters[i]:
                    found.append(_notices.conflict(frame, i, other, j))
        return found

    def _abort_open(
        self, frame: Frame, exc: BaseException, where: Where, watched: Any
    ) -> Optional[BaseException]:
        # Whatever failed or interrupted an open, undo all of it: restore every lever written
        # (each tried, and tried again if an exception interrupts its restore), take the
        # frame off its stacks, out of the open frames and out of this context. What failed
        # is returned, not raised, so that the caller raises it once the lock is released.
        # Interrupted again (a plain signal handler), the roll-back runs once more from what
        # the flags read then; whatever happens, the frame leaves every stack (a frame left
        # there half-entered would be found by every later exit of its domains). An
        # interruption met on the way (Ctrl-C during the roll-back of a refused enter) is
        # what is returned: it must reach the program, whatever else failed.
        applied = frame.applied
        failures: List[Failure] = []
        states: List[Any] = [None] * applied
        interrupts: List[BaseException] = []
        try:
            try:
                self._roll_back(frame, exc, where, applied, failures, states, interrupts)
            except BaseException as again:
                interrupts.append(again)
                failures.clear()
                self._roll_back(frame, exc, where, applied, failures, states, interrupts)
        finally:
            self._forget_frame(frame, applied, watched)
        interrupts += [e for _, e in failures if not isinstance(e, Exception)]
        failures = [(i, e) for i, e in failures if isinstance(e, Exception)]
        error = None
        if failures:
            error = _notices.roll_back_error(frame, exc, applied, failures, states)
        if not isinstance(exc, Exception):  # exc is the interruption: it propagates
            if error is not None and exc.__context__ is None:
                exc.__context__ = error  # shown with it: what could not be rolled back
            return None
        if interrupts:
            return interrupts[0]  # raised in exc's place, with exc as its context
        return error

    def _roll_back(
        self,
        frame: Frame,
        exc: BaseException,
        where: Where,
        applied: int,
        failures: List[Failure],
        states: List[Any],
        interrupts: List[BaseException],
    ) -> None:
        program = frame.program
        reason = f"rolled back: entering failed with {type(exc).__name__}"
        for i in range(applied - 1, -1, -1):
            lever = program.levers[i]
            for attempt in (1, 2):
                try:
                    current = lever.read()
                    before = frame.befores[i]
                    restored = lever.restore(before, current) if current != before else current
                    self._frame_one(frame, where, i, "restore", reason, current, restored)
                    break
                except BaseException as err:  # keep rolling back the others
                    if attempt == 2:
                        failures.append((i, err))
                        states[i] = lever.read()
                    elif not isinstance(err, Exception):  # an interruption: retried, kept
                        interrupts.append(err)

    def _forget_frame(self, frame: Frame, applied: int, watched: Any) -> None:
        # A frame whose enter was rolled back: off its stacks, closed, out of this context.
        for i in range(applied):
            self._unlink(frame, i)
        frame.applied = 0
        frame.closed = True
        self._open.pop(frame.id, None)
        frames = self._frames.get()
        if frames and frames[-1] is frame:
            self._frames.set(frames[:-1])
        _own_writes.leave(watched)

    # --- exiting -----------------------------------------------------------------------

    def _unlink(self, frame: Frame, i: int) -> None:
        key = frame.key(i)
        stack = self._stacks.get(key)
        if stack is None:
            return
        for j in range(len(stack) - 1, -1, -1):
            entry = stack[j]
            if entry[0] is frame and entry[1] == i:
                del stack[j]
                break

    def _drop_stale(self, stack: List[Tuple[Frame, int]], frame: Frame) -> None:
        # Entries of frames that are not open (a roll-back cut short by a second interrupt
        # from a plain signal handler): nothing holds them, and nothing must be re-applied
        # from them.
        opened = self._open
        stack[:] = [entry for entry in stack if entry[0] is frame or entry[0].id in opened]

    def _new_stack(self, key: Hashable) -> List[Tuple[Frame, int]]:
        # Emptied stacks are kept: dropping a thread's autocast stack at every exit and making
        # it again at the next entry cost ~0.25 µs a frame. Those of threads gone are dropped
        # here, once the stacks that are kept outnumber _KEEP_STACKS.
        stacks = self._stacks
        if len(stacks) >= _KEEP_STACKS:
            for old in [k for k, stack in stacks.items() if not stack and isinstance(k, tuple)]:
                del stacks[old]
        stack: List[Tuple[Frame, int]] = []
        stacks[key] = stack
        return stack

    def _close_buried(
        self, frame: Frame, i: int, current: Any, where: Where, notices: List[Notice]
    ) -> Any:
        # Entries above this one belong to frames still open: put back the state this entry
        # found, then re-apply theirs on top of it, in their order.
        stack = self._stacks[frame.key(i)]
        self._drop_stale(stack, frame)
        position = next(j for j, (f, k) in enumerate(stack) if f is frame and k == i)
        later = stack[position + 1 :]
        lever = frame.program.levers[i]
        top_frame, top_i = later[-1]
        del stack[position]
        state = lever.restore(frame.befores[i], current)
        if current != top_frame.afters[top_i]:
            expected = top_frame.afters[top_i]
            notices.append(_notices.drift(lever, current, expected, frame.befores[i], frame)[1])
        for other, j in later:
            other_lever = other.program.levers[j]
            other.befores[j] = state
            other.afters[j] = state = other_lever.apply(other.program.values[j], state)
            reason = f"re-applied: {short_repr(frame.label)}, entered earlier, exited first"
            self._frame_one(other, where, j, "set", reason, other.befores[j], other.afters[j])
        return state

    def _leave_context(self, frames: Tuple[Frame, ...], frame: Frame) -> Optional[Frame]:
        # ``frame`` (closed now) is not this context's innermost: drop it, and frames closed
        # from other contexts; return the innermost frame still open above it, if any.
        if frame not in frames:  # entered in another context of this thread
            return None
        later = [f for f in frames[frames.index(frame) + 1 :] if not f.closed]
        self._frames.set(tuple(f for f in frames if not f.closed))
        return later[-1] if later else None

    def _innermost_elsewhere(self, owner: object, tid: int) -> Optional[Frame]:
        # The innermost open frame of ``owner`` entered in another context of this thread: a
        # fixture set up in one asyncio task and torn down in another, a `with` around a
        # generator's `yield` closed by another consumer.
        with self._lock:
            frames = tuple(self._open.values())
        mine = [f for f in frames if f.owner is owner and f.thread_id == tid]
        return mine[-1] if mine else None
