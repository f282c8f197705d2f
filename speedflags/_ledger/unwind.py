"""A frame's levers taken off their stacks other than by the hot close: an open rolled back,
a close under later frames or interrupted, a frame whose thread ended.

:meth:`FlagLedger.close <speedflags.FlagLedger.close>` restores the top of each of its
frame's stacks itself. Everything else that takes a frame's levers off their stacks is here,
so that the rules are written once: an entry under later ones restores the state it found
and re-applies theirs on top; an entry whose frame is not open (a roll-back cut short) is
dropped, never re-applied; a lever whose restore was interrupted is finished from what the
stack and the state say now, whatever part of it ran. Each step can run twice (a plain
signal handler interrupting it again) and looks at the state rather than trusting a step
counter. Everything here runs under the ledger's lock, and only *builds* warnings and errors
(:mod:`.notices`): the ledger speaks once the lock is released.

- :func:`roll_back`: an open that failed or was interrupted, undone whole;
- :class:`Unwind`: one close off its hot path, lever by lever (drift, a lever under later
  frames, a restore that raised), and its completion when interrupted;
- :func:`abandon`: the frame of a thread that ended (or does not exist after a fork).
"""

from __future__ import annotations

from typing import Any

from .._short_repr import short_repr
from .._tracing import Where
from . import notices as _notices
from . import own_writes as _own_writes
from .frame import Frame
from .notices import Failure, Notice
from .ring import Ring
from .stacks import Stack, Stacks

__all__ = ["BURIED_NOTE", "HELD_NOTE", "Unwind", "abandon", "roll_back"]

BURIED_NOTE = "closed under frames entered later; see the records around it"
# a decorated generator's or coroutine's step closing as its body suspends (.suspend)
HELD_NOTE = "held by the body across a yield or await: put back when it resumes"


# --- one lever off its stack ------------------------------------------------------------------


def _stack(stacks: Stacks, frame: Frame, i: int) -> Stack:
    """The stack of lever ``i`` of ``frame`` (empty if there is none): keyed by its domain,
    or by (domain, thread) if it is thread-local (as ``Frame.key``)."""
    program = frame.program
    key = program.keys[i]
    return stacks.by_key.get((program.domains[i], frame.thread_id) if key is None else key) or []


def _position(stack: Stack, frame: Frame, i: int) -> int | None:
    """Where lever ``i`` of ``frame`` is on ``stack``, if it is there."""
    return next((j for j, (f, k) in enumerate(stack) if f is frame and k == i), None)


def _drop_stale(stacks: Stacks, stack: Stack, frame: Frame) -> None:
    """Drop the entries of frames that are not open (a roll-back cut short by a second
    interrupt from a plain signal handler): nothing holds them, and nothing must be
    re-applied from them."""
    opened = stacks.open
    stack[:] = [entry for entry in stack if entry[0] is frame or entry[0].id in opened]


def unlink(stacks: Stacks, frame: Frame, i: int) -> None:
    """Take lever ``i`` of ``frame`` off its stack, if it is there."""
    stack = _stack(stacks, frame, i)
    position = _position(stack, frame, i)
    if position is not None:
        del stack[position]


def _finish_lever(stacks: Stacks, ring: Ring, frame: Frame, i: int, where: Where) -> Any:
    """Bring lever ``i`` of ``frame`` back, whatever part of its exit already ran: off its
    stack, and the state what the stack says should hold now. Returns the state left."""
    lever = frame.program.levers[i]
    stack = _stack(stacks, frame, i)
    _drop_stale(stacks, stack, frame)
    position = _position(stack, frame, i)
    current = lever.read()
    if position is not None and position < len(stack) - 1:
        return _close_buried(ring, stack, position, frame, i, current, where)
    if position is not None:
        stack.pop()
    if stack:  # its entry is gone already, under others: what the top asked for holds
        top, j = stack[-1]  # (another lever of the domain, maybe: tf32 under precision)
        return top.program.levers[j].apply(top.program.values[j], current)
    before = frame.befores[i]
    return lever.restore(before, current) if current != before else current


def _close_buried(
    ring: Ring, stack: Stack, position: int, frame: Frame, i: int, current: Any, where: Where
) -> Any:
    """Lever ``i`` of ``frame`` is under entries of frames still open: put back the state it
    found, then re-apply theirs on top of it, in their order."""
    later = stack[position + 1 :]
    lever = frame.program.levers[i]
    del stack[position]
    state = lever.restore(frame.befores[i], current)
    reason = f"re-applied: {short_repr(frame.label)}, entered earlier, exited first"
    for other, j in later:
        other.befores[j] = state
        other.afters[j] = state = other.program.levers[j].apply(other.program.values[j], state)
        ring.frame_one(other, where, j, "set", reason, other.befores[j], other.afters[j])
    return state


# --- an open rolled back ----------------------------------------------------------------------


def roll_back(
    stacks: Stacks, ring: Ring, frame: Frame, exc: BaseException, where: Where, watched: Any
) -> BaseException | None:
    """Whatever failed or interrupted an open (``exc``), undo all of it.

    Restore every lever written (each tried, and tried again if an exception interrupts its
    restore), take the frame off its stacks, out of the open frames and out of this context.
    What failed is returned, not raised, so that the caller raises it once the lock is
    released. Interrupted again (a plain signal handler), the roll-back runs once more from
    what the flags read then; whatever happens, the frame leaves every stack (a frame left
    there half-entered would be found by every later exit of its domains). An interruption
    met on the way (Ctrl-C during the roll-back of a refused enter) is what is returned: it
    must reach the program, whatever else failed.
    """
    applied = frame.applied
    failures: list[Failure] = []
    states: list[Any] = [None] * applied
    interrupts: list[BaseException] = []
    try:
        try:
            _restore_applied(ring, frame, exc, where, failures, states, interrupts)
        except BaseException as again:
            interrupts.append(again)
            failures.clear()
            _restore_applied(ring, frame, exc, where, failures, states, interrupts)
    finally:
        _forget(stacks, frame, applied, watched)
    interrupts += [f.error for f in failures if not isinstance(f.error, Exception)]
    failures = [f for f in failures if isinstance(f.error, Exception)]
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


def _restore_applied(
    ring: Ring,
    frame: Frame,
    exc: BaseException,
    where: Where,
    failures: list[Failure],
    states: list[Any],
    interrupts: list[BaseException],
) -> None:
    program = frame.program
    reason = f"rolled back: entering failed with {type(exc).__name__}"
    for i in range(frame.applied - 1, -1, -1):
        lever = program.levers[i]
        for attempt in (1, 2):
            try:
                current = lever.read()
                before = frame.befores[i]
                restored = lever.restore(before, current) if current != before else current
                ring.frame_one(frame, where, i, "restore", reason, current, restored)
                break
            except BaseException as err:  # keep rolling back the others
                if attempt == 2:
                    failures.append(Failure(i, err))
                    states[i] = lever.read()
                elif not isinstance(err, Exception):  # an interruption: retried, kept
                    interrupts.append(err)


def _forget(stacks: Stacks, frame: Frame, applied: int, watched: Any) -> None:
    # A frame whose enter was rolled back: off its stacks, closed, out of this context.
    for i in range(applied):
        unlink(stacks, frame, i)
    frame.applied = 0
    frame.closed = True
    stacks.open.pop(frame.id, None)
    stacks.leave(frame)
    _own_writes.leave(watched)


# --- a close off its hot path -----------------------------------------------------------------


class Unwind:
    """One close off its hot path: made by :meth:`FlagLedger.close
    <speedflags.FlagLedger.close>` at its first lever that is not simply restored from the
    top of its stack, it keeps what the close must say and raise once the lock is released.

    ``found`` and ``restored`` are the close's own lists (per lever, by index: what it read,
    what it left); ``notes`` the records' notes (made on first use), ``notices`` the warnings,
    ``failures`` the restores that failed, ``pending`` an interruption raised once the exit
    is complete. Drift found on the way is kept in ``drifts`` and worded once every lever is
    restored, by :meth:`settle` (the words ask the watch who wrote the flag).

    Example:
        >>> import threading
        >>> from speedflags._ledger.ring import Ring
        >>> from speedflags._ledger.stacks import Stacks
        >>> from speedflags._ledger.unwind import Unwind
        >>> unwind = Unwind(Stacks(threading.RLock()), Ring(16), None, None, [], [])
        >>> unwind.notes, unwind.notices, unwind.failures, unwind.pending
        (None, [], [], None)
    """

    __slots__ = (
        "drifts",
        "failures",
        "found",
        "frame",
        "notes",
        "notices",
        "pending",
        "restored",
        "ring",
        "stacks",
        "where",
    )

    def __init__(
        self,
        stacks: Stacks,
        ring: Ring,
        frame: Any,
        where: Where,
        found: list[Any],
        restored: list[Any],
    ) -> None:
        self.stacks = stacks
        self.ring = ring
        self.frame: Frame = frame
        self.where = where
        self.found = found
        self.restored = restored
        self.notes: list[str] | None = None
        self.notices: list[Notice] = []
        self.failures: list[Failure] = []
        self.pending: BaseException | None = None
        # (lever, found, expected, whether its note is the record's): worded by settle()
        self.drifts: list[tuple[int, Any, Any, bool]] = []

    def _note(self, i: int, note: str) -> None:
        if self.notes is None:
            self.notes = [""] * self.frame.applied
        self.notes[i] = note

    def drifted(self, i: int, found: Any) -> None:
        """Lever ``i`` was found changed inside the block (its restore is made): its note
        and its warning; or, closing as a decorated body suspends, what the body holds."""
        frame = self.frame
        held = getattr(frame, "suspending", None)  # a decorated generator's or coroutine's
        if held is not None:  # body suspends: its own, set aside until it resumes (.suspend)
            held[i] = found
            self._note(i, HELD_NOTE)
            return
        self.drifts.append((i, found, frame.afters[i], True))

    def settle(self) -> list[str] | None:
        """Word the drift found so far (each lever's warning, and its record's note where
        the drift is the note), once; the records' notes."""
        frame = self.frame
        drifts = self.drifts
        while drifts:
            i, found, expected, noted = drifts.pop(0)
            lever = frame.program.levers[i]
            note, notice = _notices.drift(lever, found, expected, frame.befores[i], frame)
            self.notices.append(notice)
            if noted:
                self._note(i, note)
        return self.notes

    def buried(self, i: int) -> None:
        """Lever ``i`` is under later frames (or off its stack: an interrupted exit's): put
        back what it found under them, re-applying theirs (a change found there is drift)."""
        frame = self.frame
        stack = _stack(self.stacks, frame, i)
        _drop_stale(self.stacks, stack, frame)
        position = _position(stack, frame, i)
        self._note(i, BURIED_NOTE)
        if position is not None and position < len(stack) - 1:
            top, j = stack[-1]
            if self.found[i] != top.afters[j]:  # the later frame's state did not hold: drift
                self.drifts.append((i, self.found[i], top.afters[j], False))
        self.restored[i] = _finish_lever(self.stacks, self.ring, frame, i, self.where)

    def failed(self, i: int, exc: BaseException) -> None:
        """Lever ``i``'s restore raised ``exc``: try once more, from what the state and the
        stacks say now. An exception that interrupted the restore (Ctrl-C) does not recur,
        and the exit then raises it once complete; a real failure fails again and is
        reported."""
        frame = self.frame
        lever = frame.program.levers[i]
        if self.found[i] is None:  # interrupted before its state was read: nothing written yet
            self.found[i] = lever.read()
        try:
            self.restored[i] = _finish_lever(self.stacks, self.ring, frame, i, self.where)
        except BaseException as again:
            unlink(self.stacks, frame, i)  # no stale entry is left on its stack
            # interrupted again (a plain handler): the interruption is what the exit raises,
            # not what the first try ran into (an entry an earlier exit had taken off)
            failed = exc if isinstance(again, Exception) else again
            self.failures.append(Failure(i, failed))
            self._note(i, f"failed: {type(failed).__name__}: {failed}")
            self.restored[i] = lever.read()
            return
        self._note(i, f"restored again after {type(exc).__name__}")
        if not isinstance(exc, LookupError):
            # (a LookupError: its stack entry was gone, an earlier exit of this frame,
            # interrupted twice, had finished this lever already: nothing to report)
            self.pending = self.pending or exc

    def interrupted(self, exc: BaseException, watched: Any) -> None:
        """An exception interrupted the close outside its per-lever loop: complete the exit
        (the levers it had not reached, the frame closed, its record), then raise ``exc``
        once the exit is done."""
        frame = self.frame
        levers = frame.program.levers
        found, restored = self.found, self.restored
        for i in range(len(found) - 1, -1, -1):
            if found[i] is None:  # not reached by close(): what it finds is what was found
                found[i] = levers[i].read()
            self._finish_if_on_a_stack(i)
            # closed already (nothing to restore): what it reads now; a plain statement last,
            # not an `if` (tests/test_exception_table_holes.py)
            restored[i] = levers[i].read() if restored[i] is None else restored[i]
        frame.closed = True
        frame.task = None
        self.stacks.open.pop(frame.id, None)
        # the close may have recorded it before the interruption (checked here, off its hot
        # path)
        notes = self.settle()  # recorded already or not, the drift's warnings are said
        if not self.ring.closed_last(frame):
            self.ring.closed(frame, self.where, found, restored, notes)
        _own_writes.leave(watched)
        self.pending = self.pending or exc

    def _finish_if_on_a_stack(self, i: int) -> None:
        if _position(_stack(self.stacks, self.frame, i), self.frame, i) is None:
            return
        try:
            self.restored[i] = _finish_lever(self.stacks, self.ring, self.frame, i, self.where)
        except Exception:
            unlink(self.stacks, self.frame, i)


# --- a frame whose thread ended ---------------------------------------------------------------


def abandon(stacks: Stacks, ring: Ring, frame: Frame, where: Where) -> Notice:
    """Restore the process-wide levers of ``frame``, whose thread ended inside its block (or
    does not exist after a fork), under any later frames (which keep their values); drop its
    thread-local ones (they ended with the thread); record ``restore`` with an ``abandoned``
    note. Its warning."""
    program = frame.program
    n = frame.applied
    found: list[Any] = [None] * n
    restored: list[Any] = [None] * n
    notes = [""] * n
    for i in range(n - 1, -1, -1):
        lever = program.levers[i]
        if program.keys[i] is None:  # thread-local: it ended with its thread
            unlink(stacks, frame, i)
            notes[i] = "abandoned: thread-local state, ended with its thread"
            continue
        try:
            found[i] = lever.read()
            restored[i] = _finish_lever(stacks, ring, frame, i, where)
            notes[i] = f"abandoned: thread {short_repr(frame.thread)} ended inside the block"
        except Exception as exc:
            unlink(stacks, frame, i)
            notes[i] = f"failed: {type(exc).__name__}: {exc}"
    frame.closed = True
    frame.task = None
    stacks.open.pop(frame.id, None)
    ring.closed(frame, where, found, restored, notes)
    return _notices.abandoned(frame)
