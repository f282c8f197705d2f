"""The FlagLedger: every lever change goes through here, is recorded, and is undone exactly.

The ledger knows levers only through the :class:`~speedflags.levers._base.Lever` protocol;
what it runs is a :class:`~speedflags._program.Program` per frame, and what it records goes
into a ring of compact entries (:mod:`speedflags._history`).

Stacks. For each piece of torch state (a lever *domain*) the ledger keeps a stack of the
open frames that set it, each with the state it found. Process-wide domains have one stack;
thread-local ones (autocast) one per thread. Closing the top entry restores the state it
found. Closing an entry below others (a frame of another thread that exits first, or an
out-of-order exit) restores the state it found and then re-applies the entries above it, so
every frame still open keeps what it asked for and the base state comes back once the last
one exits.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Tuple

from . import _notices
from ._history import (
    RESTORE,
    SET,
    FlagRecord,
    Where,
    expand,
    format_where,
    json_default,
    now,
    one_entry,
    records,
    to_json,
)
from ._notices import Failure, Notice
from ._program import Frame, LeverItem, Program
from .errors import LedgerOrderError

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
    "set_rank_source",
]

DEFAULT_HISTORY_SIZE = 4096
_get_ident = threading.get_ident
_current_thread = threading.current_thread


def _no_rank() -> Optional[int]:
    return None


# Tells the calling process's rank in a torch.distributed job (None without one);
# speedflags.distributed installs the real source, so the ledger needs no torch.distributed.
# Read once per frame.
_rank_source: Callable[[], Optional[int]] = _no_rank


def set_rank_source(source: Callable[[], Optional[int]]) -> None:
    """Install the function that says the process's rank (``speedflags.distributed`` does)."""
    global _rank_source
    _rank_source = source


class FlagLedger:
    """Applies, records and restores lever changes for a process.

    Use :func:`speedflags.ledger` for the process's ledger: the flags it guards are
    process-wide, so all frames must go through one ledger. Scope: process; its operations
    are thread-safe (one lock), and thread-local levers (autocast) are kept per thread.
    Closing a frame restores each of its levers to the state it found.

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
        if not _is_positive_int(history_size):
            raise ValueError(f"history_size={history_size!r}: expected a positive int")
        self._history_size = history_size
        # Levers never call back into the ledger, so a plain (cheaper) lock is enough.
        self._lock = threading.Lock()
        # domain -> [(frame, index)] (process scope); (domain, thread id) -> ... (thread scope)
        self._stacks: Dict[Hashable, List[Tuple[Frame, int]]] = {}
        self._threads: Dict[int, List[Frame]] = {}
        # Each entry holds one or more records, so the ring never needs more entries than
        # records kept.
        self._history: Deque[tuple[Any, ...]] = deque(maxlen=history_size)
        self._seq = 0
        self._frame_ids = itertools.count(1)

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

    def open_frames(self) -> tuple[Frame, ...]:
        """Every frame open now, in all threads, in order of entry."""
        with self._lock:
            frames = [f for stack in self._threads.values() for f in stack]
        return tuple(sorted(frames, key=lambda f: f.id))

    def to_json(self, indent: Optional[int] = None) -> str:
        """The history as JSON, with the PyTorch and speedflags versions and the process id."""
        return to_json(self.history, indent)

    def __repr__(self) -> str:
        return f"<FlagLedger: {len(self._history)} entries, {len(self.open_frames())} open frames>"

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
        thread = _current_thread().name
        rank = _rank_source()
        with self._lock:
            entry = self._one(label, 0, thread, rank, where, lever, action, reason, before, after)
        return expand(entry)[0]

    def _one(
        self,
        label: str,
        frame_id: int,
        thread: str,
        rank: Optional[int],
        where: Where,
        lever: str,
        action: str,
        reason: str,
        before: Any,
        after: Any,
    ) -> tuple[Any, ...]:
        # a single record; the caller holds the lock
        self._seq += 1
        entry = one_entry(
            self._seq, label, frame_id, thread, rank, where, lever, action, reason, before, after
        )
        self._history.append(entry)
        return entry

    def _frame_one(
        self, frame: Frame, where: Where, i: int, action: str, reason: str, before: Any, after: Any
    ) -> None:
        key = frame.program.lever_keys[i]
        self._one(
            frame.label,
            frame.id,
            frame.thread,
            frame.rank,
            where,
            key,
            action,
            reason,
            before,
            after,
        )

    # --- frames --------------------------------------------------------------------------

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
        If any lever fails, the levers already applied are restored before the error
        propagates.
        """
        tid = _get_ident()
        frame = Frame(
            label, owner, where, device, program, tid, _current_thread().name, None, _rank_source()
        )
        frame.id = next(self._frame_ids)
        befores = frame.befores
        afters = frame.afters
        stacks = self._stacks
        with self._lock:
            for i, lever, check in program.reads:
                state = befores[i] = lever.read()
                if check:
                    lever.check(state)  # may refuse: nothing has changed yet
            i = 0
            try:
                for i, lever, value, p, key, domain, hook in program.rows:
                    before = befores[i] if p < 0 else afters[p]
                    befores[i] = before
                    if key is None:
                        key = (domain, tid)
                    stack = stacks.get(key)
                    if stack is None:
                        stack = stacks[key] = []
                    # Pushed before writing, so a write that fails half-way is rolled back too.
                    stack.append((frame, i))
                    frame.applied = i + 1
                    afters[i] = lever.apply(value, before)
                    if hook:
                        lever.opened()
            except BaseException as exc:
                error = self._roll_back(frame, i, exc, where)
                if error is not None:
                    raise error  # noqa: B904 - its cause is set; raised as the lock is released
                raise
            n = program.n
            self._seq += n
            self._history.append(
                (SET, self._seq - n + 1, now(), label, frame.id, frame.thread, frame.rank, where,
                 program.lever_keys, program.reasons, tuple(befores), tuple(afters))
            )  # fmt: skip
            if program.skipped:
                for name, reason in program.skipped:
                    self._one(
                        label,
                        frame.id,
                        frame.thread,
                        frame.rank,
                        where,
                        name,
                        "skip",
                        reason,
                        None,
                        None,
                    )
            frames = self._threads.get(tid)
            if frames is None:
                self._threads[tid] = [frame]
            else:
                frames.append(frame)
        return frame

    def _roll_back(
        self, frame: Frame, failed: int, exc: BaseException, where: Where
    ) -> Optional[BaseException]:
        # Every applied lever is tried; what failed is reported, not raised, so that the
        # caller raises it only once the lock is released.
        failures: List[Failure] = []
        program = frame.program
        applied = frame.applied
        states: List[Any] = [None] * applied
        for i in range(applied - 1, -1, -1):
            lever = program.levers[i]
            try:
                current = lever.read()
                before = frame.befores[i]
                restored = lever.restore(before, current) if current != before else current
                reason = f"rolled back: entering failed with {type(exc).__name__}"
                self._frame_one(frame, where, i, "restore", reason, current, restored)
            except BaseException as err:  # keep rolling back the others
                failures.append((i, err))
                states[i] = lever.read()
            finally:
                self._unlink(frame, i)
                if program.hooks[i] and i != failed:
                    lever.closed()
        frame.applied = 0
        frame.closed = True
        if not failures:
            return None
        interrupts = [e for _, e in failures if not isinstance(e, Exception)]
        if interrupts:
            return interrupts[0]
        return _notices.roll_back_error(frame, exc, applied, failures, states)

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
        if not stack and isinstance(key, tuple):
            # per-thread stacks go with their thread; process stacks are few and reused
            del self._stacks[key]

    def innermost(self, owner: object) -> Frame:
        """The calling thread's innermost open frame entered through ``owner``."""
        frames = self._threads.get(_get_ident(), ())
        for frame in reversed(frames):
            if frame.owner is owner:
                return frame
        raise LedgerOrderError(
            f"{owner!r} is exited but was not entered in this thread "
            "(each 'with' must exit in the thread that entered it)"
        )

    def close(self, frame: Frame, where: Where = None) -> None:
        """Restore every lever of ``frame`` (in reverse order, trying each one) and close it.

        Every lever is restored first; warnings (drift) and errors come after, once the
        frame is off every stack and the ledger's lock is released.

        Raises:
            LedgerOrderError: the frame is closed already, belongs to another thread, or is
                not the thread's innermost frame. In the last case the frame is still
                closed correctly (frames opened after it keep their levers) before raising.
            RestoreError: several levers could not be restored; its message names those
                restored and those not (with what they read now). A single failure is
                raised as itself.
        """
        tid = _get_ident()
        failures: Optional[List[Failure]] = None
        notices: Optional[List[Notice]] = None
        with self._lock:
            if frame.closed:
                raise LedgerOrderError(f"frame {frame.label!r} ({frame.where}) is already closed")
            if frame.thread_id != tid:
                raise LedgerOrderError(
                    f"frame {frame.label!r} was entered in thread {frame.thread!r} and cannot be "
                    f"exited from thread {_current_thread().name!r}; nothing was restored"
                )
            program = frame.program
            befores = frame.befores
            afters = frame.afters
            stacks = self._stacks
            n = frame.applied
            found: List[Any] = [None] * n
            restored: List[Any] = [None] * n
            notes: Optional[List[str]] = None
            rows = program.rows
            for k in range(n - 1, -1, -1):
                i, lever, _, _, key, domain, hook = rows[k]
                try:
                    if key is None:
                        key = (domain, tid)
                    stack = stacks[key]
                    top_frame, top_i = stack[-1]
                    current = found[i] = lever.read()
                    if top_frame is frame and top_i == i:
                        stack.pop()
                        if not stack and key.__class__ is tuple:
                            del stacks[key]
                        before = befores[i]
                        try:
                            restored[i] = (
                                lever.restore(before, current) if current != before else current
                            )
                        finally:
                            if hook:
                                lever.closed()
                        if current != afters[i]:
                            if notes is None:
                                notes = [""] * n
                            if notices is None:
                                notices = []
                            notes[i], notice = _notices.drift(
                                lever, current, afters[i], before, frame
                            )
                            notices.append(notice)
                    else:
                        if notices is None:
                            notices = []
                        restored[i] = self._close_buried(frame, i, current, where, notices)
                        if notes is None:
                            notes = [""] * n
                        notes[i] = "closed under frames entered later; see the records around it"
                except BaseException as exc:  # every lever is restored even if one fails
                    self._unlink(frame, i)  # no stale entry is left on its stack
                    if failures is None:
                        failures = []
                    failures.append((i, exc))
                    if notes is None:
                        notes = [""] * n
                    notes[i] = f"failed: {type(exc).__name__}: {exc}"
                    restored[i] = lever.read()
            frame.closed = True
            self._seq += n
            self._history.append(
                (RESTORE, self._seq - n + 1, now(), frame.label, frame.id, frame.thread,
                 frame.rank, where, program.lever_keys[:n], tuple(notes) if notes else None,
                 tuple(found), tuple(restored))
            )  # fmt: skip
            frames = self._threads[tid]
            innermost: Optional[Frame] = frames[-1]
            if innermost is frame:
                frames.pop()
                innermost = None
            else:
                frames.remove(frame)
            if not frames:
                del self._threads[tid]
        if notices or failures or innermost is not None:
            _notices.speak(
                notices, _notices.close_error(frame, innermost, failures or (), restored)
            )

    def _close_buried(
        self, frame: Frame, i: int, current: Any, where: Where, notices: List[Notice]
    ) -> Any:
        # Entries above this one belong to frames still open: put back the state this entry
        # found, then re-apply theirs on top of it, in their order.
        stack = self._stacks[frame.key(i)]
        position = next(j for j, (f, k) in enumerate(stack) if f is frame and k == i)
        later = stack[position + 1 :]
        lever = frame.program.levers[i]
        top_frame, top_i = later[-1]
        del stack[position]
        try:
            state = lever.restore(frame.befores[i], current)
        finally:
            if frame.program.hooks[i]:
                lever.closed()
        if current != top_frame.afters[top_i]:
            expected = top_frame.afters[top_i]
            notices.append(_notices.drift(lever, current, expected, frame.befores[i], frame)[1])
        for other, j in later:
            other_lever = other.program.levers[j]
            other.befores[j] = state
            other.afters[j] = state = other_lever.apply(other.program.values[j], state)
            reason = f"re-applied: {frame.label!r}, entered earlier, exited first"
            self._frame_one(other, where, j, "set", reason, other.befores[j], other.afters[j])
        return state


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
