"""Callers interrupted around an enter or an exit: the one place that handles them.

An exception (Ctrl-C, any exception a signal handler raises) can land in the caller of the
ledger: after :meth:`FlagLedger.open <speedflags.FlagLedger.open>` returned but before the
caller kept the frame, or after an exit began but before the ledger's close did. The ledger
itself is whole either way (an open completed or rolled back; a close completed); what is
left is a frame nobody holds. The frame API (:class:`~speedflags.FrameScope`
and the decorators of :mod:`.decorate`) handles it here, once:

- an enter reads ``mark``, the id of the last frame opened, before it opens; interrupted,
  it calls :func:`close_left_open` with it, which closes the frame its owner opened after
  ``mark``, if any;
- an exit interrupted before the ledger's close began calls :func:`close_left_open`
  without one, which closes the owner's innermost frame unless it is closed already;
- :func:`call_framed` runs a call inside a frame with both, and makes a close interrupted at
  its first instruction again.

Each of them ends in the loop that runs the :func:`~speedflags.signal_safe` handlers held
back meanwhile (:func:`~speedflags._ledger.interrupts.deliver_pending`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._tracing import Where
from ..errors import SpeedflagsError
from .interrupts import PENDING, critical, deliver_pending

if TYPE_CHECKING:
    from .frame import Frame
    from .protocol import FrameLedger, Scope

__all__ = ["call_framed", "close_innermost", "close_left_open", "innermost_here"]


@critical
def close_innermost(ledger: FrameLedger, owner: object, where: Where = None) -> None:
    """``ledger.close(ledger.innermost(owner), where)``: what an exit does (its caller, an
    ``__exit__``, delivers the handlers held back)."""
    frames = ledger.stacks.context.get()
    frame = frames[-1] if frames else None
    if frame is not None and frame.owner is owner and not frame.closed:
        return ledger.close(frame, where)
    return ledger.close(innermost_here(ledger, owner), where)


def innermost_here(ledger: FrameLedger, owner: object) -> Frame:
    """``ledger.innermost(owner)``; with none in this thread but one open in another, the
    error ``Frame.close()`` from this thread would raise (nothing is restored; the frame stays
    open for its own thread): an exit and ``stop()`` from another thread are refused alike."""
    if ledger.stacks.find(owner) is None:
        other = ledger.stacks.elsewhere(owner)
        if other is not None:
            raise ledger.threads.not_closable(other)
    return ledger.innermost(owner)


@critical
def close_left_open(
    ledger: FrameLedger, owner: object, where: Where = None, opened_after: int | None = None
) -> None:
    """Close the frame an interrupted enter or exit of ``owner`` left open in this context.

    - An enter interrupted between a successful open and its own return passes
      ``opened_after``, the ledger's last frame id read before the open: the frame on top of
      this context is closed if ``owner`` opened it after that id.
    - An exit interrupted by an exception (not the ledger's own error) before the ledger
      closed the frame passes none: ``owner``'s innermost frame here is closed unless it is
      closed already (found closed, the exit did happen; a scope nested directly in itself
      whose outer exit is interrupted before it starts is left open: its inner frame, closed,
      is found first).

    One function for both, so that one ``finally`` runs the
    :func:`~speedflags.signal_safe` handlers deferred in here (or by the failed open or close
    before it) before it returns.
    """
    try:
        frame = _left_open(ledger.stacks.here(), owner, opened_after)
        if frame is not None and not frame.closed:
            ledger.close(frame, where)
    finally:
        while True:  # the drain (interrupts.py): no check point after its last test
            if not PENDING:
                break
            deliver_pending()


def _left_open(frames: tuple[Frame, ...], owner: object, opened_after: int | None) -> Frame | None:
    # What close_left_open closes, found by a function of its own: a loop inside its try would
    # be a hole in it on Python 3.13 (tests/test_exception_table_holes.py)
    if opened_after is not None:  # an enter's: on top, opened after the mark
        top = frames[-1] if frames else None
        if top is not None and top.owner is owner and top.id > opened_after:
            return top
        return None
    for frame in reversed(frames):  # an exit's: the innermost of owner, closed or not
        if frame.owner is owner:
            return frame
    return None


def call_framed(
    scope: Scope,
    label: str,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: Where,
) -> Any:
    """``func(*args, **kwargs)`` inside a frame of ``scope`` labelled ``label``: what every
    decorated plain call runs.

    An exception that lands between the ledger's open and the ``try``, or before the
    ledger's close begins, is caught too: the frame opened is closed (``close_left_open``), and a
    close interrupted before it began is made again.
    """
    the_ledger = scope.ledger
    mark = the_ledger.stacks.last_id
    frame = None
    try:
        frame = scope.open_frame(label, where)
        return func(*args, **kwargs)
    finally:
        # frame None: the open failed, or an exception came between it and here
        try:
            if frame is None:
                close_left_open(the_ledger, scope, where, opened_after=mark)
            else:
                the_ledger.close(frame, where)
        except SpeedflagsError:
            raise
        except BaseException:  # interrupted before the exit began: exit now
            if frame is None:
                close_left_open(the_ledger, scope, where, opened_after=mark)
            elif not frame.closed:
                the_ledger.close(frame, where)
            raise
