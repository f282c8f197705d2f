"""What the body of a decorated generator or coroutine holds across a ``yield`` or ``await``.

A decorator on a generator, coroutine or async generator function (:mod:`.decorate`) opens
a frame around each *step* of the body and closes it when the body suspends, so the code that
runs meanwhile (the generator's consumer, other tasks on the event loop) never sees the
decorator's levers. The body may hold state of its own across the suspension:

- a block it entered and has not exited yet (``async with fast_math(...)``, a ``with`` around
  a ``yield``): a frame open above the step's frame in its thread or task;
- a change of its own to one of the step's levers that it still holds (``with
  torch.autocast("cpu", enabled=False):`` around an ``await``).

Both belong to the body. They are set aside with the step's levers when it suspends (the
frames above the step's are closed, innermost first, and each close keeps what it finds
changed as the body's, not drift) and put back when it resumes (the step's frame opens, the
states the body held are written back over its levers, and the frames are opened again above
it, each as the same :class:`~.frame.Frame`, with the states they held). So, across a
suspension, the body finds everything as it left it, and the step's levers never override
what the body set; meanwhile nothing of the body is in force. A step ended by an exception
sets the body's frames aside too: they are opened again for its finishing while the body can
still run (so its exits close them), and stay closed once it has ended.

A frame's ``afters`` stay what it applied, whatever is put back over it: a lever found there
when it closes is no drift (the body's own region ended: ``torch.autocast``'s exit writes back
the state it found, the step's), and a change the body still holds when it ends is. A frame
closing at a suspension carries a dict, ``frame.suspending`` (unset or ``None`` on every other
frame): its close puts there, instead of taking it for drift, each lever it finds changed (the
last lever of its domain, on top of its stack: the ledger's drift check, read once), and that
is what the body holds.
The records say it: a ``restore`` whose note reads :data:`HELD_NOTE` when the step suspends,
and a ``set`` whose reason reads :data:`PUT_BACK` when it resumes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .frame import Frame
from .interrupts import PENDING, critical, deliver_pending
from .own_writes import _WRITING, section
from .unwind import HELD_NOTE

if TYPE_CHECKING:
    from .._tracing import Where
    from .protocol import FrameLedger

__all__ = ["HELD_NOTE", "PUT_BACK", "Suspended", "put_back", "reopen"]

PUT_BACK = "put back: held by the body across a yield or await"


class Suspended:
    """One call of a decorated generator, coroutine or async generator: what its body holds
    while it is suspended (:meth:`suspend` when a step ends at a ``yield``/``await``,
    :meth:`resume` once the next step's frame is open).

    Example:
        >>> from speedflags._ledger.suspend import Suspended
        >>> held = Suspended(None)
        >>> held.frames, held.states
        ([], {})
    """

    __slots__ = ("body", "frames", "states")

    def __init__(self, body: Any = None) -> None:
        # the generator, coroutine or async generator whose body this is
        self.body = body
        # lever index -> state: the step frame's levers the body changed and holds
        self.states: dict[int, Any] = {}
        # the frames the body holds, set aside, outermost first, each with its held states
        self.frames: list[tuple[Frame, dict[int, Any]]] = []

    def __bool__(self) -> bool:
        return bool(self.states or self.frames)

    def alive(self) -> bool:
        """Whether the body can still run (suspended, not ended): only then do the frames it
        held open again for it to exit them."""
        body = self.body
        frame = getattr(
            body, "gi_frame", getattr(body, "cr_frame", getattr(body, "ag_frame", None))
        )
        return frame is not None

    def suspend(self, ledger: FrameLedger, step: Frame, where: Where, own: bool = True) -> None:
        """The body suspends: close the frames it holds above ``step`` (innermost first),
        keeping what each holds, and (``own``) mark ``step`` so that its close keeps what the
        body holds of its levers (the caller closes it next) instead of taking it for drift.
        ``own=False``: the step ends by an exception, and only its frames are set aside
        (a change of the step's levers it left is drift, as in any block)."""
        frames = ledger.stacks.here()
        if frames and frames[-1] is not step and step in frames:  # the body holds frames
            for frame in reversed([f for f in frames[frames.index(step) + 1 :] if not f.closed]):
                states: dict[int, Any] = {}  # filled by its close: what the body holds
                frame.suspending = states
                self._keep(frame, states)  # first: the close may raise an interruption
                ledger.close(frame, where)
        if own:
            step.suspending = self.states = {}

    def _keep(self, frame: Frame, states: dict[int, Any]) -> None:
        # outermost first; once (a reopen interrupted after it reopened left it listed)
        self.frames[:] = [(frame, states)] + [e for e in self.frames if e[0] is not frame]

    def resume(self, ledger: FrameLedger, step: Frame, where: Where) -> None:
        """The body resumes: ``step`` (just opened) takes back the states the body held of
        its levers, and the frames it held open again above it, as they were."""
        if self.states:
            put_back(ledger, step, self.states, where)
        frames = self.frames  # interrupted: the step's end sets aside those reopened again
        while frames:
            frame, states = frames[0]
            reopen(ledger, frame)
            del frames[0]
            put_back(ledger, frame, states, frame._where)


@critical
def put_back(ledger: FrameLedger, frame: Frame, states: dict[int, Any], where: Where) -> None:
    """Write back over ``frame``'s levers (just opened) the states the body held of them, and
    record each as a ``set``. The frame's ``afters`` stay what it applied: what it finds
    when it closes is compared with them (a change the body still holds then is drift)."""
    try:
        if states:
            _write_back(ledger, frame, states, where)
    finally:  # signal_safe handlers deferred in here
        while True:  # the drain (interrupts.py): no check point after its last test
            if not PENDING:
                break
            deliver_pending()


def _write_back(ledger: FrameLedger, frame: Frame, states: dict[int, Any], where: Where) -> None:
    program = frame.program
    with ledger.lock, section(ledger, frame.label, where):
        tid = threading.get_ident()
        _WRITING.add(tid)
        try:
            for i, state in states.items():
                if not ledger.stacks.on_top(frame, i):
                    continue  # another thread's frame holds the domain now: it is theirs
                lever = program.levers[i]
                current = lever.read()
                after = lever.restore(state, current) if current != state else current
                ledger.ring.frame_one(frame, where, i, "set", PUT_BACK, current, after)
        finally:
            _WRITING.discard(tid)


@critical
def reopen(ledger: FrameLedger, frame: Frame) -> None:
    """Open ``frame`` (closed when its body suspended) again, as the same object: a frame
    opened anew with its levers, whose place ``frame`` then takes everywhere (its id, its
    stack entries, the innermost of this context), so that whoever holds it closes it."""
    mark = ledger.stacks.last_id
    try:
        new = ledger.open(frame.program, frame.label, frame._where, frame.owner, frame.device)
        with ledger.lock:
            _adopt(ledger, frame, new)
    except BaseException:  # interrupted (a plain handler) before its place was all taken:
        _adopt_orphan(ledger, frame, mark)  # take it now, as close_left_open finds an open's
        raise
    finally:  # signal_safe handlers deferred in here
        while True:  # the drain (interrupts.py): no check point after its last test
            if not PENDING:
                break
            deliver_pending()


def _adopt(ledger: FrameLedger, frame: Frame, new: Frame) -> None:
    # ``frame`` takes ``new``'s place: its state, its id, its stack entries, this context's
    for name in _SLOTS:
        setattr(frame, name, getattr(new, name))
    frame.suspending = None
    ledger.stacks.adopt(frame, new)
    new.closed = True


def _adopt_orphan(ledger: FrameLedger, frame: Frame, mark: int) -> None:
    # The frame opened for ``frame`` after ``mark``, still this context's innermost under its
    # own object: ``frame`` takes its place (again: _adopt is whole when repeated).
    frames = ledger.stacks.here()
    new = frames[-1] if frames else None
    if new is None or new is frame or new.owner is not frame.owner:
        return
    if new.id > mark and not new.closed:
        with ledger.lock:
            _adopt(ledger, frame, new)


_SLOTS = tuple(name for name in Frame.__slots__ if name != "suspending")
