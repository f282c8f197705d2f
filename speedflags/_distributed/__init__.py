"""Consistency across ranks: every rank of a ``torch.distributed`` job runs with the same flags.

One rank with TF32 on and another with it off (or cuDNN deterministic on some ranks only)
compute different numbers; data-parallel replicas then drift apart without any error of
their own. :func:`check_ranks` gathers every rank's :func:`~speedflags.snapshot` (levers and
guarded settings, less those each rank may hold its own value of: the default device, the
thread count) and raises :class:`~speedflags.RankMismatchError` naming what differs. It
works with whatever backend the process group uses (gloo on CPUs, NCCL on GPUs).

This package's ``__init__`` holds the check; what is compared and how differences read is
in :mod:`.compare`, and the exchange (the rank, the process group, the JSON gather, the rank
on ledger records) in :mod:`.exchange`. Their names used elsewhere stay importable from here.

May import: :mod:`speedflags._status`, the ledger, the levers and the base modules; never
``fast_math`` or anything above it (``fast_math`` imports this package for its rank check).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._ledger import ledger as _ledger
from .._ledger.decorate import caller_where
from .._locks import new_lock
from .._short_repr import set_module, short_repr
from ..errors import InvalidTypeError, RankMismatchError

# Re-exported (``X as X``) for report.py and the tests, which use them as distributed.X.
from .compare import ABSENT as ABSENT
from .compare import describe_values as describe_values
from .compare import differences as differences
from .compare import flatten as flatten
from .compare import levers_of as levers_of
from .compare import rank_state as rank_state
from .compare import verdict as verdict
from .exchange import AVAILABLE as AVAILABLE
from .exchange import current_rank as current_rank
from .exchange import gather as gather
from .exchange import process_group as process_group

__all__ = ["RankSnapshot", "check_ranks"]

_dist: Any = torch.distributed


@set_module("speedflags")
class RankSnapshot(dict[str, Any]):
    """The state every rank shares, as returned by :func:`check_ranks`: a ``dict``.

    It holds :func:`speedflags.snapshot`'s entries that every rank must share (not the
    default device, the thread count, grad mode or autocast's cache and depth), and says
    how it was obtained. Scope: a read of the calling
    thread's and the process's flags; it changes and restores nothing.

    Attributes:
        checked: True when other ranks were compared (a process group exists).
        rank: this process's rank in the group (None without one).
        world_size: how many ranks were compared (1 without a process group).
        backend: the process group's backend (``"gloo"``, ``"nccl"``), or None.
        reason: what was done, in words.

    Example:
        >>> import speedflags
        >>> common = speedflags.check_ranks()  # no process group here: checks nothing
        >>> common.checked, common.world_size
        (False, 1)
        >>> common["cudnn_benchmark"] == speedflags.snapshot()["cudnn_benchmark"]
        True
    """

    checked: bool
    rank: int | None
    world_size: int
    backend: str | None
    reason: str

    def __init__(
        self,
        state: dict[str, Any],
        *,
        checked: bool,
        rank: int | None,
        world_size: int,
        backend: str | None,
        reason: str,
    ) -> None:
        super().__init__(state)
        self.checked = checked
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.reason = reason


def _payload(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "torch": torch.__version__,
        "state": state,
    }


def _compare(payloads: Sequence[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    states = [{"torch": {"__version__": p["torch"]}, **p["state"]} for p in payloads]
    return differences(states)


def check_ranks(group: Any = None, *, label: str = "check_ranks()") -> RankSnapshot:
    """Check that every rank runs with the same flags; return the state they share.

    Gathers every rank's :func:`speedflags.snapshot` (and the determinism flags cuDNN
    ``enabled``/``deterministic``, oneDNN ``enabled``, ``torch.use_deterministic_algorithms``
    and the reduced-precision reductions) through ``torch.distributed.all_gather``, with the
    group's own backend: gloo, or NCCL (which gathers on ``torch.cuda.current_device()``,
    so call ``torch.cuda.set_device(local_rank)`` first, as DDP needs anyway).
    It is a collective: every rank of ``group`` must call it. Every rank raises the same
    error, so none goes on alone into the next collective.

    Without an initialised process group (or when this process is not in ``group``) it
    compares nothing, says so in the result's ``reason`` and in the ledger, and returns this
    process's state. Scope: reads the process's flags and the calling thread's autocast;
    changes and restores nothing. Recorded on the ledger as lever ``"ranks"``, action
    ``"check"``.

    Args:
        group: the ``torch.distributed`` process group to check (default: the default group).
        label: the label of the ledger record.

    Returns:
        A :class:`RankSnapshot`: the shared state (a dict), with ``checked``, ``rank``,
        ``world_size``, ``backend`` and ``reason``.

    Raises:
        RankMismatchError: some rank differs; the message names each lever, each getter
            and the value on each rank.
        InvalidTypeError: ``group`` is not a process group, or ``label`` not a str.

    Example:
        >>> import speedflags
        >>> result = speedflags.check_ranks()
        >>> result.reason
        'no torch.distributed process group: nothing to compare'
    """
    if not isinstance(label, str):
        raise InvalidTypeError(f"check_ranks(label={short_repr(label)}): expected a str")
    if group is not None and (not AVAILABLE or not isinstance(group, _dist.ProcessGroup)):
        raise InvalidTypeError(
            f"check_ranks(group={short_repr(group)}): expected a torch.distributed ProcessGroup "
            "or None (None: the default group)"
        )
    where = caller_where(2)
    state = rank_state()
    info = process_group(group)
    if info is None:
        reason = (
            "no torch.distributed process group: nothing to compare"
            if group is None
            else "this process is not a member of the group: nothing to compare"
        )
        _ledger.ledger().note("ranks", "check", reason, label=label, where=where)
        return RankSnapshot(
            state, checked=False, rank=None, world_size=1, backend=None, reason=reason
        )
    rank, world_size, backend = info
    gathered = gather(_payload(state), group)
    diffs = _compare(gathered)
    if diffs:
        line = verdict(diffs, world_size)
        _ledger.ledger().note("ranks", "check", f"{line} ({backend})", label=label, where=where)
        hosts = "; ".join(f"rank {i}: {p['host']} pid {p['pid']}" for i, p in enumerate(gathered))
        raise RankMismatchError(
            f"{label}: the {world_size} ranks of this {backend} process group run with "
            f"different flags, so their results differ and data-parallel replicas drift "
            f"apart. {line}. ({hosts}.) Fix: set the flags the same way on every rank, for "
            "example the same speedflags.fast_math(...) block around the whole step.",
            levers_of(diffs),
            diffs,
        )
    reason = f"all {world_size} ranks agree ({backend})"
    _ledger.ledger().note("ranks", "check", reason, label=label, where=where)
    return RankSnapshot(
        state, checked=True, rank=rank, world_size=world_size, backend=backend, reason=reason
    )


class FirstEntryCheck:
    """``check_ranks`` at the first entry of a spec that has a process group, then never.

    ``fast_math(check_ranks=True)`` holds one; so can any decorator that opens ledger
    frames. Call it right after the frame's levers are applied. Entries made while no
    process group exists check nothing (the first of them is recorded) and leave the check
    for the first entry that has one. Thread-safe; once done, a call costs one attribute
    read.
    """

    __slots__ = ("_check_lock", "_noted", "done", "group")

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.done = False
        self._noted = False
        self._check_lock = new_lock()

    def __call__(self, label: str, undo: Callable[[], None]) -> None:
        """Check once; if the check raises, call ``undo`` (close the frame) and re-raise."""
        if self.done:
            return
        with self._check_lock:
            self._check_once(label, undo)

    def _check_once(self, label: str, undo: Callable[[], None]) -> None:
        if self.done:  # another thread checked while this one waited for the lock
            return
        if process_group(self.group) is None:
            if not self._noted:
                self._noted = True
                _ledger.ledger().note(
                    "ranks",
                    "check",
                    "no torch.distributed process group yet: nothing compared; the first "
                    "entry with one will check",
                    label=label,
                )
            return
        try:
            check_ranks(self.group, label=label)
        except BaseException:
            undo()
            raise
        self.done = True
