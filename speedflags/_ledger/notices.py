"""What the ledger says: drift and conflict warnings, order and restore errors.

The ledger restores first and speaks after. While it holds its lock it only *builds* these
(plain data: a cause, a message, a category; an exception object); :func:`speak` emits them
once every lever is restored, the frame is off every stack and the lock is released. So a
warning turned into an error (``warnings.simplefilter("error")``, pytest's
``filterwarnings = error``) cannot skip a restore, and a ``warnings.showwarning`` hook or a
logging handler that reads the ledger or enters a block cannot deadlock on its lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from .. import _warn
from .._short_repr import short_repr
from ..errors import (
    AbandonedFrameWarning,
    DriftWarning,
    LedgerOrderError,
    LeverConflictWarning,
    RestoreError,
)
from ..levers._base import Lever
from .frame import Frame


class Notice(NamedTuple):
    """A warning built under the lock, spoken after it."""

    cause: Hashable  # said once per cause (warn_once)
    message: str
    category: type | None  # None: informational, logged once, never a warning


class Failure(NamedTuple):
    """A lever whose restore (or roll-back) failed."""

    lever: int  # the lever's index in its frame's program
    error: BaseException


def speak(notices: Sequence[Notice] | None, error: BaseException | None = None) -> None:
    """Emit ``notices`` (each once per cause), then raise ``error`` if there is one.

    A notice that raises (warnings as errors) does not hide ``error``: that one is raised
    instead, with the warning as its ``__context__``.
    """
    try:
        for cause, message, category in notices or ():
            if category is None:
                _warn.log_once(cause, message)
            else:
                _warn.warn_once(cause, message, category)
    finally:
        if error is not None:
            raise error


def speak_closed(
    frame: Frame,
    innermost: Frame | None,
    notices: list[Notice] | None,
    unwind: Any,
    states: Sequence[Any],
) -> None:
    """What a close says once its lock is released: ``notices`` (frames of threads that
    ended), what its :class:`~.unwind.Unwind` found (drift, failures, an interruption), an
    order error if ``innermost`` (a later frame) is still open; ``states``: what each lever
    reads after the exit."""
    failures = () if unwind is None else unwind.failures
    said = [*(notices or ()), *(() if unwind is None else unwind.notices)]
    error = close_error(frame, innermost, failures, states)
    speak(said, error if unwind is None else unwind.pending or error)


def drift(
    lever: Lever, found: Any, expected: Any, restoring: Any, frame: Frame
) -> tuple[str, Notice]:
    """The history note and the warning for a lever changed inside ``frame``'s block.

    A change PyTorch made by itself (seen by a running watch) is not the block's: it is
    restored all the same, and said once, as information (logged), not as a warning.
    """
    from ..levers.culprits import culprit_note, made_by_torch  # local: a drift is rare

    by_torch = made_by_torch(lever, expected, found)
    if by_torch is not None:
        message = (
            f"{lever.name} was changed inside {_entered(frame)} by PyTorch itself, not by the "
            f"block: {by_torch}; restoring {lever.describe(restoring)!r}."
        )
        note = f"changed by PyTorch itself: found {lever.describe(found)!r}"
        return note, Notice(("torch", lever.name, found), message, None)
    message = (
        f"{lever.name} was changed inside {_entered(frame)}: found "
        f"{lever.describe(found)!r} where the block had set {lever.describe(expected)!r}; "
        f"restoring {lever.describe(restoring)!r}."
    )
    message += culprit_note(lever, found)
    note = f"drift: found {lever.describe(found)!r}, expected {lever.describe(expected)!r}"
    return note, Notice((lever.name, found, expected, restoring), message, DriftWarning)


def _entered(frame: Frame, who: str = "") -> str:
    # a frame as messages name it: its label (a user's value: shortened) and where it began
    where = f"{frame.where} in {who}" if who else f"{frame.where}"
    return f"{short_repr(frame.label)} (entered at {where})"


def _who(frame: Frame) -> str:
    task = frame.task
    if task is None:
        return f"thread {short_repr(frame.thread)}"
    get_name = getattr(task, "get_name", None)
    name = get_name() if get_name is not None else repr(task)
    return f"thread {short_repr(frame.thread)}, task {short_repr(name)}"


def conflicts(by_key: dict[Hashable, Any], frame: Frame) -> list[Notice]:
    """Once ``frame`` is applied: the frames of other threads or tasks, still open, whose
    state for a domain it has just replaced with a different one (``by_key``: the ledger's
    stacks)."""
    found: list[Notice] = []
    program = frame.program
    for i in range(program.n):
        if i in program.prev:  # a later lever of this frame sets the same domain
            continue
        theirs: dict[int, tuple[Frame, int]] = {}
        for other, j in by_key[frame.key(i)]:
            if other is frame:
                break
            if other.thread_id != frame.thread_id or other.task is not frame.task:
                theirs[other.id] = (other, j)  # its last lever of the domain counts
        found += [
            conflict(frame, i, o, j) for o, j in theirs.values() if o.afters[j] != frame.afters[i]
        ]
    return found


def abandoned(frame: Frame) -> Notice:
    """The warning for ``frame``, left open by a thread that ended (or, after a fork, does
    not exist), once its process-wide levers are restored."""
    program = frame.program
    shared = [program.levers[i].name for i in range(frame.applied) if program.keys[i] is not None]
    message = (
        f"{short_repr(frame.label)} (entered at {frame.where} in thread "
        f"{short_repr(frame.thread)}) was still open when thread {short_repr(frame.thread)} "
        "ended (or, after a fork, does not exist "
        f"in this process); no thread can exit it, so its process-wide levers were "
        f"restored here: {', '.join(shared) or 'none'}."
    )
    return Notice(
        ("abandoned", frame.label, frame.where, frame.thread), message, AbandonedFrameWarning
    )


def conflict(frame: Frame, i: int, other: Frame, j: int) -> Notice:
    """The warning for ``frame`` setting lever ``i`` over ``other``'s lever ``j``, still open."""
    lever = frame.program.levers[i]
    theirs = other.program.levers[j]
    mine = f"{lever.name}={lever.describe_value(frame.program.values[i])!r}"
    before = f"{theirs.name}={theirs.describe_value(other.program.values[j])!r}"
    if lever.scope == "process":
        shared = "the flag is process-wide"
    elif lever.scope == "model":
        shared = "the model is shared by every thread that calls it"
    else:
        shared = f"the flag is per thread, and both run in thread {short_repr(frame.thread)}"
    message = (
        f"{_entered(frame, _who(frame))} sets {mine} while {_entered(other, _who(other))}, "
        f"which set {before}, is still open: {shared}, so {short_repr(other.label)} now runs "
        f"with {mine} until {short_repr(frame.label)} exits. Each block still restores what it "
        "found on exit; keep such blocks in one thread and one task, or give them the same "
        "values (docs/threading.md)."
    )
    cause = ("conflict", lever.name, other.label, other.where, frame.label, frame.where)
    return Notice(cause, message, LeverConflictWarning)


def _failed(frame: Frame, failures: Sequence[Failure]) -> str:
    levers = frame.program.levers
    return ", ".join(f"{levers[i].name} ({type(e).__name__}: {e})" for i, e in failures)


def _reads(frame: Frame, failures: Sequence[Failure], states: Sequence[Any]) -> str:
    levers = frame.program.levers
    return ", ".join(
        f"{levers[i].name} now reads {levers[i].describe(states[i])!r}" for i, _ in failures
    )


def _first(failure: Failure) -> int:
    return failure.lever


def _others(frame: Frame, n: int, failures: Sequence[Failure]) -> str:
    failed = {i for i, _ in failures}
    names = [frame.program.levers[i].name for i in range(n) if i not in failed]
    return ", ".join(names) if names else "none"


def close_error(
    frame: Frame, innermost: Frame | None, failures: Sequence[Failure], states: Sequence[Any]
) -> BaseException | None:
    """What closing ``frame`` raises, if anything: an interrupt, an order error, a failure.

    ``states`` holds, per lever, what it reads after the exit.
    """
    errors = [e for _, e in failures]
    interrupts = [e for e in errors if not isinstance(e, Exception)]
    if interrupts:
        return interrupts[0]
    cause = errors[0] if errors else None
    error: BaseException
    if innermost is not None:
        error = LedgerOrderError(
            f"frame {_entered(frame)} exited while {short_repr(innermost.label)} (entered later, "
            f"at {innermost.where}) is still open in this thread and task; blocks must exit in "
            "reverse order of entry. The exited frame's "
            "levers were restored and the later frame keeps its own."
        )
    elif len(errors) == 1:
        return errors[0]
    elif errors:
        n = frame.applied
        failures = sorted(failures, key=_first)
        error = RestoreError(
            f"restoring {_entered(frame)} failed for {len(errors)} of "
            f"its {n} levers: {_failed(frame, failures)}; restored: "
            f"{_others(frame, n, failures)}. Not restored: {_reads(frame, failures, states)}.",
            [e for _, e in failures],
        )
    else:
        return None
    error.__cause__ = cause
    return error


def roll_back_error(
    frame: Frame,
    exc: BaseException,
    applied: int,
    failures: Sequence[Failure],
    states: Sequence[Any],
) -> RestoreError:
    """What entering raises when rolling back ``exc``'s half-entered frame failed too."""
    failures = sorted(failures, key=_first)
    error = RestoreError(
        f"entering {short_repr(frame.label)} failed ({type(exc).__name__}: {exc}) and rolling "
        f"it back failed for {_failed(frame, failures)}; rolled back: "
        f"{_others(frame, applied, failures)}. Not rolled back: "
        f"{_reads(frame, failures, states)}.",
        [e for _, e in failures],
    )
    error.__cause__ = failures[0].error
    return error
