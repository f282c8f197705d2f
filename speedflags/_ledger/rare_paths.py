"""The ledger off its hot path: rolling back an enter, closing under later frames, conflicts.

:class:`~speedflags.FlagLedger` keeps its hot path (open and close of a frame that is the
innermost of its stacks) in :mod:`.ledger`. What happens when a lever fails, a frame
exits under another thread's frames, or a frame overrides another thread's or task's, is
here: :class:`RarePaths` (``FlagLedger.rare_paths``), a part of the ledger. Its methods run
under the ledger's lock and only *build* warnings and errors: the ledger speaks once the
lock is released (:mod:`speedflags._ledger.notices`).
"""

from __future__ import annotations

from typing import Any

from .._short_repr import short_repr
from . import notices as _notices
from . import own_writes as _own_writes
from .frame import Frame
from .history import Where
from .notices import Failure, Notice
from .ring import Ring
from .stacks import Stacks

BURIED_NOTE = "closed under frames entered later; see the records around it"
# a decorated generator's or coroutine's step closing as its body suspends (.suspend)
HELD_NOTE = "held by the body across a yield or await: put back when it resumes"


class RarePaths:
    """What the ledger does when a frame is not simply the top of its stacks: a part of
    :class:`~speedflags.FlagLedger`, working on two others, its open frames (``stacks``)
    and its history (``ring``).

    Example:
        >>> import threading
        >>> from speedflags._ledger.rare_paths import RarePaths
        >>> from speedflags._ledger.ring import Ring
        >>> from speedflags._ledger.stacks import Stacks
        >>> rare_paths = RarePaths(Stacks(threading.RLock()), Ring(16))
        >>> rare_paths.stacks.open, len(rare_paths.ring)
        ({}, 0)
    """

    __slots__ = ("ring", "stacks")

    def __init__(self, stacks: Stacks, ring: Ring) -> None:
        self.stacks = stacks
        self.ring = ring

    # --- entering ----------------------------------------------------------------------

    def conflicts(self, frame: Frame) -> list[Notice]:
        """Once ``frame`` is applied: the frames of other threads or tasks, still open,
        whose state for a domain it has just replaced with a different one."""
        found: list[Notice] = []
        program = frame.program
        by_key = self.stacks.by_key
        for i in range(program.n):
            if i in program.prev:  # a later lever of this frame sets the same domain
                continue
            theirs: dict[int, tuple[Frame, int]] = {}
            for other, j in by_key[frame.key(i)]:
                if other is frame:
                    break
                if other.thread_id != frame.thread_id or other.task is not frame.task:
                    theirs[other.id] = (other, j)  # its last lever of the domain counts
            for other, j in theirs.values():
                if other.afters[j] != frame.afters[i]:
                    found.append(_notices.conflict(frame, i, other, j))
        return found

    def abort_open(
        self, frame: Frame, exc: BaseException, where: Where, watched: Any
    ) -> BaseException | None:
        """Whatever failed or interrupted an open, undo all of it.

        Restore every lever written (each tried, and tried again if an exception interrupts
        its restore), take the frame off its stacks, out of the open frames and out of this
        context. What failed is returned, not raised, so that the caller raises it once the
        lock is released. Interrupted again (a plain signal handler), the roll-back runs once
        more from what the flags read then; whatever happens, the frame leaves every stack
        (a frame left there half-entered would be found by every later exit of its
        domains). An interruption met on the way (Ctrl-C during the roll-back of a refused
        enter) is what is returned: it must reach the program, whatever else failed.
        """
        applied = frame.applied
        failures: list[Failure] = []
        states: list[Any] = [None] * applied
        interrupts: list[BaseException] = []
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
        failures: list[Failure],
        states: list[Any],
        interrupts: list[BaseException],
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
                    self.ring.frame_one(frame, where, i, "restore", reason, current, restored)
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
            self.stacks.unlink(frame, i)
        frame.applied = 0
        frame.closed = True
        self.stacks.open.pop(frame.id, None)
        self.stacks.leave(frame)
        _own_writes.leave(watched)

    # --- exiting -----------------------------------------------------------------------

    def drifted(
        self,
        frame: Frame,
        i: int,
        found: Any,
        notes: list[str] | None,
        notices: list[Notice] | None,
    ) -> tuple[list[str], list[Notice]]:
        """Lever ``i`` of ``frame`` was found changed inside its block: its record's note
        and the warning (the lists made on first use)."""
        notes = notes if notes is not None else [""] * frame.applied
        notices = notices if notices is not None else []
        held = getattr(frame, "suspending", None)  # a decorated generator's or coroutine's
        if held is not None:  # body suspends: its own, set aside until it resumes (.suspend)
            held[i] = found
            notes[i] = HELD_NOTE
            return notes, notices
        lever = frame.program.levers[i]
        notes[i], notice = _notices.drift(lever, found, frame.afters[i], frame.befores[i], frame)
        notices.append(notice)
        return notes, notices

    def buried(
        self,
        frame: Frame,
        i: int,
        where: Where,
        restored: list[Any],
        notes: list[str] | None,
        notices: list[Notice] | None,
    ) -> tuple[list[str], list[Notice]]:
        """Close lever ``i`` of ``frame``, found under later frames (or off its stack: an
        interrupted exit's): its restored state, its record's note, any warning."""
        notices = notices if notices is not None else []
        restored[i] = self.finish_lever(frame, i, where, notices)
        notes = notes if notes is not None else [""] * frame.applied
        notes[i] = BURIED_NOTE
        return notes, notices

    def finish_lever(self, frame: Frame, i: int, where: Where, notices: list[Notice]) -> Any:
        """Bring lever ``i`` of ``frame`` back, whatever part of its exit already ran: off
        its stack, and the state what the stack says should hold now."""
        lever = frame.program.levers[i]
        stack = self.stacks.by_key.get(frame.key(i)) or []
        self.stacks.drop_stale(stack, frame)
        position = next((j for j, (f, k) in enumerate(stack) if f is frame and k == i), None)
        current = lever.read()
        if position is not None and position < len(stack) - 1:
            return self.close_buried(frame, i, current, where, notices)
        if position is not None:
            stack.pop()
        if stack:  # its entry is gone already, under others: what the top asked for holds
            top, j = stack[-1]  # (another lever of the domain, maybe: tf32 under precision)
            return top.program.levers[j].apply(top.program.values[j], current)
        before = frame.befores[i]
        return lever.restore(before, current) if current != before else current

    def close_buried(
        self, frame: Frame, i: int, current: Any, where: Where, notices: list[Notice]
    ) -> Any:
        """Lever ``i`` of ``frame`` is under entries of frames still open: put back the state
        it found, then re-apply theirs on top of it, in their order."""
        stack = self.stacks.by_key[frame.key(i)]
        self.stacks.drop_stale(stack, frame)
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
            self.ring.frame_one(other, where, j, "set", reason, other.befores[j],
                                   other.afters[j])  # fmt: skip
        return state
