"""The frames open now, a part of :class:`~speedflags.FlagLedger`: every open frame, the
stack of each domain, and the open frames of each context.

Stacks. For each piece of torch state (a lever *domain*) the ledger keeps a stack of the
open frames that set it, each with the state it found. Process-wide domains have one stack;
thread-local ones (autocast) one per thread. Closing the top entry restores the state it
found. Closing an entry below others (a frame of another thread that exits first, or an
out-of-order exit) restores the state it found and then re-applies the entries above it, so
every frame still open keeps what it asked for.

Contexts. Which frames are open, and in which order they must exit, is kept per
``contextvars`` context: each thread, and each asyncio task, has its own tuple of open
frames (a task created inside a block starts from a copy, and never changes its parent's).
The tuple is immutable and set anew by each open, so a task inherits a snapshot.

Everything here runs with the ledger's lock held, but what reads or sets only the calling
context (:meth:`Stacks.here`, :meth:`Stacks.find`, :meth:`Stacks.elsewhere`,
:meth:`Stacks.leave_context`; the last three take the lock to look at other contexts).
Which of these structures is the truth for what (the stacks for a domain's state, a
context's tuple for its innermost frame), and why closed frames stay in that tuple:
``docs/architecture.md``, "The ledger's invariants".
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from contextvars import ContextVar
from typing import Any

from .._short_repr import short_repr
from ..errors import LedgerOrderError
from .frame import Frame, without_closed

_KEEP_STACKS = 64
Stack = list[tuple[Frame, int]]


class Stacks:
    """The frames open now: by id (``open``), per domain (``by_key``) and per context
    (``context``), and the id of the last frame opened (``last_id``). A part of
    :class:`~speedflags.FlagLedger`; the ledger's hot path binds these containers once.

    Example:
        >>> import speedflags
        >>> from speedflags._ledger.stacks import Stacks
        >>> frames = Stacks(speedflags.ledger().lock)
        >>> frames.find(object()) is None  # no frame open for it here
        True
    """

    __slots__ = ("by_key", "context", "last_id", "lock", "open")

    def __init__(self, lock: Any) -> None:
        self.lock = lock  # the ledger's (a threading.RLock)
        # domain -> [(frame, index)] (process scope); (domain, thread id) -> ... (thread scope)
        self.by_key: dict[Hashable, Stack] = {}
        # every open frame, of every thread and context, by id (so in order of entry)
        self.open: dict[int, Frame] = {}
        # the open frames of the current context (thread or asyncio task), innermost last,
        # and on top of them maybe frames closed since (skipped; dropped by the next open)
        self.context: ContextVar[tuple[Frame, ...]] = ContextVar(
            f"speedflags_frames_{id(self):x}", default=()
        )
        # the last frame's id: an enter interrupted after the ledger opened its frame finds
        # the frame by it (:func:`~.entering.close_left_open`)
        self.last_id = 0

    # --- stacks -------------------------------------------------------------------------

    def new_stack(self, key: Hashable) -> Stack:
        """A new, empty stack for ``key``.

        Emptied stacks are kept for the next frame (docs/architecture.md, "The hot path");
        once the stacks kept outnumber ``_KEEP_STACKS``, the empty ones are dropped here:
        those of threads gone, of models gone or no longer under a lever (a domain per
        model), and the few a next frame makes again.
        """
        stacks = self.by_key
        if len(stacks) >= _KEEP_STACKS:
            for old in [k for k, stack in stacks.items() if not stack]:
                del stacks[old]
        stack: Stack = []
        stacks[key] = stack
        return stack

    def on_top(self, frame: Frame, i: int) -> bool:
        """Whether lever ``i`` of ``frame`` is the top of its stack (else another frame's
        state holds its domain)."""
        stack = self.by_key.get(frame.key(i))
        if not stack:
            return False
        top, j = stack[-1]
        return top is frame and j == i

    def adopt(self, frame: Frame, new: Frame) -> None:
        """``frame`` takes the place of ``new``, just opened for it: its id among the open
        frames, its stack entries, its place in this context (a decorated body's frame
        opened again as the same object, :mod:`.suspend`)."""
        self.open[new.id] = frame
        for i in range(new.applied):
            stack = self.by_key[new.key(i)]
            stack[:] = [(frame, k) if f is new else (f, k) for f, k in stack]
        self.context.set(tuple(frame if f is new else f for f in self.context.get()))

    def forget(self) -> None:
        """Drop every frame everywhere, restoring nothing (for tests that left frames open)."""
        for frame in self.open.values():
            frame.closed = True
        self.open.clear()
        self.by_key.clear()
        self.context.set(())

    # --- contexts -----------------------------------------------------------------------

    def here(self) -> tuple[Frame, ...]:
        """This context's open frames, innermost last (and maybe, on top, frames closed
        since: the next open drops them)."""
        return self.context.get()

    def find(self, owner: object) -> Frame | None:
        """The innermost open frame entered through ``owner`` in this context, else in
        another context of this thread (a fixture set up in one asyncio task and torn down
        in another, a ``with`` around a generator's ``yield`` closed by another consumer)."""
        for frame in reversed(self.context.get()):
            if frame.owner is owner and not frame.closed:
                return frame
        tid = threading.get_ident()
        with self.lock:
            frames = tuple(self.open.values())
        mine = [f for f in frames if f.owner is owner and f.thread_id == tid]
        return mine[-1] if mine else None

    def innermost(self, owner: object) -> Frame:
        """:meth:`find`, or ``LedgerOrderError`` saying why ``owner`` has no open frame."""
        frame = self.find(owner)
        if frame is not None:
            return frame
        # closed frames stay in the context's tuple until the next open drops them
        exited = next((f for f in reversed(self.context.get()) if f.owner is owner), None)
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

    def elsewhere(self, owner: object) -> Frame | None:
        """The innermost open frame entered through ``owner`` in another thread, if any."""
        tid = threading.get_ident()
        with self.lock:
            frames = tuple(self.open.values())
        theirs = [f for f in frames if f.owner is owner and f.thread_id != tid and not f.closed]
        return theirs[-1] if theirs else None

    def push(self, frame: Frame) -> None:
        """Make ``frame`` this context's innermost (dropping frames closed on top)."""
        context = self.context
        frames = context.get()
        if frames and frames[-1].closed:  # the common case: close() left one there
            frames = frames[:-1]
            if frames and frames[-1].closed:
                frames = without_closed(frames)
        context.set(frames + (frame,))  # noqa: RUF005

    def left(self, frames: tuple[Frame, ...], frame: Frame) -> Frame | None:
        """``frame`` (closed now) was left: it stays in ``frames``, this context's tuple, if it
        is the innermost past frames closed already (the next open drops it); else it is
        dropped (:meth:`leave_context`). The innermost frame still open above it, if any."""
        k = len(frames) - 1
        while k >= 0 and frames[k] is not frame and frames[k].closed:
            k -= 1
        if k >= 0 and frames[k] is frame:
            return None
        return self.leave_context(frames, frame)

    def leave_context(self, frames: tuple[Frame, ...], frame: Frame) -> Frame | None:
        """``frame`` (closed now) is not this context's innermost: drop it, and frames closed
        from other contexts; return the innermost frame still open above it, if any."""
        if frame not in frames:  # entered in another context of this thread
            return None
        later = [f for f in frames[frames.index(frame) + 1 :] if not f.closed]
        self.context.set(tuple(f for f in frames if not f.closed))
        return later[-1] if later else None

    def leave(self, frame: Frame) -> None:
        """Take ``frame`` (whose enter was rolled back) off the top of this context."""
        frames = self.context.get()
        if frames and frames[-1] is frame:
            self.context.set(frames[:-1])
