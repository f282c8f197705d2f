"""Consistency across ranks: every rank of a ``torch.distributed`` job runs with the same flags.

One rank with TF32 on and another with it off (or cuDNN deterministic on some ranks only)
compute different numbers; data-parallel replicas then drift apart without any error of
their own. :func:`check_ranks` gathers every rank's :func:`~speedflags.snapshot`, plus the
determinism flags that are not levers, and raises :class:`~speedflags.RankMismatchError`
naming what differs. It works with whatever backend the process group uses (gloo on CPUs,
NCCL on GPUs). The states travel as JSON through ``torch.distributed.all_gather``:
``all_gather_object`` would need NumPy (it converts through ``Tensor.numpy()`` on 2.4 to
2.15), which neither PyTorch nor speedflags depends on, and JSON needs no unpickling of what
other processes sent.

Ledger records carry the rank of the process that made them (``FlagRecord.rank``); it is
read once per frame, from a value cached per process group.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _ledger
from ._decorate import caller_where
from .errors import InvalidTypeError, RankMismatchError
from .levers._base import Unreadable
from .status import snapshot

__all__ = ["RankSnapshot", "check_ranks"]

_dist: Any = torch.distributed
# Feature detection: some builds (and old macOS/Windows wheels) have no torch.distributed.
AVAILABLE: bool = bool(_dist.is_available())
_GroupMember: Any = _dist.GroupMember if AVAILABLE else None

# --- the rank, for ledger records ------------------------------------------------------------


def _dead() -> None:
    return None


# (weak reference to the default process group, this process's rank in it). Weak: holding
# the group would keep it alive after destroy_process_group().
_cached: Tuple[Callable[[], Any], Optional[int]] = (_dead, None)


def current_rank() -> Optional[int]:
    """This process's rank in the default process group; ``None`` without one.

    Called once per ledger frame: an attribute read and a weak-reference call while the
    group stays the same.
    """
    global _cached
    world = _GroupMember.WORLD
    if world is None:
        return None
    cached_world, rank = _cached
    if cached_world() is not world:
        rank = int(_dist.get_rank())
        _cached = (weakref.ref(world), rank)
    return rank


if AVAILABLE:
    _ledger.set_rank_source(current_rank)


def process_group(group: Any = None) -> Optional[Tuple[int, int, str]]:
    """``(rank, world size, backend)`` of ``group`` (default: the default group), or None.

    None when there is no initialised process group or this process is not in ``group``.
    """
    if not AVAILABLE or not _dist.is_initialized():
        return None
    rank = int(_dist.get_rank(group))
    if rank < 0:
        return None
    return rank, int(_dist.get_world_size(group)), str(_dist.get_backend(group))


# --- what is compared ------------------------------------------------------------------------

# Flags that are not levers but change results, so ranks must agree on them too:
# (name shown to users, object, attribute)
_NUMERICS: Tuple[Tuple[str, Any, str], ...] = (
    ("torch.backends.cudnn.enabled", torch.backends.cudnn, "enabled"),
    ("torch.backends.cudnn.deterministic", torch.backends.cudnn, "deterministic"),
    ("torch.backends.mkldnn.enabled", torch.backends.mkldnn, "enabled"),
    (
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        torch.backends.cuda.matmul,
        "allow_fp16_reduced_precision_reduction",
    ),
    (
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        torch.backends.cuda.matmul,
        "allow_bf16_reduced_precision_reduction",
    ),
)


def rank_state() -> Dict[str, Any]:
    """What ranks must agree on: :func:`speedflags.snapshot` plus a ``"numerics"`` entry.

    ``"numerics"`` holds cuDNN ``enabled``/``deterministic``, oneDNN ``enabled``,
    ``torch.use_deterministic_algorithms`` and the reduced-precision reduction flags, each
    present only where this PyTorch has it. Never raises.
    """
    numerics: Dict[str, Any] = {}
    for shown, owner, attribute in _NUMERICS:
        try:
            numerics[shown] = getattr(owner, attribute)
        except AttributeError:  # not in this PyTorch: left out, and shown as absent
            continue
        except RuntimeError as exc:
            numerics[shown] = Unreadable.from_exception(exc)
    numerics["torch.are_deterministic_algorithms_enabled()"] = (
        torch.are_deterministic_algorithms_enabled()
    )
    numerics["torch.is_deterministic_algorithms_warn_only_enabled()"] = (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )
    state = snapshot()
    state["numerics"] = numerics
    return state


class _Absent:
    """A getter one rank has and another has not (ranks on different PyTorch versions)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Absent)

    def __hash__(self) -> int:
        return hash(_Absent)

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def flatten(state: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"tf32": {"getter": v}}`` -> ``{"tf32.getter": v}`` (the keys users see)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def differences(states: Sequence[Dict[str, Any]]) -> Dict[str, Tuple[Any, ...]]:
    """Each flattened getter whose value is not the same on every rank: its value per rank."""
    flat = [flatten(state) for state in states]
    keys: List[str] = []
    for one in flat:
        keys += [key for key in one if key not in keys]
    out: Dict[str, Tuple[Any, ...]] = {}
    for key in keys:
        values = tuple(one.get(key, ABSENT) for one in flat)
        if any(value != values[0] for value in values[1:]):
            out[key] = values
    return out


def _ranges(ranks: Sequence[int]) -> str:
    parts: List[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def describe_values(values: Sequence[Any]) -> str:
    """``"False on ranks 0, 2-3; True on rank 1"``: each value once, with where it is."""
    groups: List[Tuple[Any, List[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in groups:
            if seen == value:
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return "; ".join(f"{value!r} on {_ranges(ranks)}" for value, ranks in groups)


def levers_of(diffs: Dict[str, Tuple[Any, ...]]) -> Tuple[str, ...]:
    """The top-level names (``"tf32"``, ``"numerics"``, ``"torch"``) of differing getters."""
    out: List[str] = []
    for key in diffs:
        lever = key.split(".", 1)[0]
        if lever not in out:
            out.append(lever)
    return tuple(out)


def verdict(diffs: Dict[str, Tuple[Any, ...]], world_size: int) -> str:
    """One line: whether the ranks agree, and where they do not."""
    if not diffs:
        return f"consistent: all {world_size} ranks run with the same flags"
    levers = levers_of(diffs)
    details = "; ".join(f"{key}: {describe_values(values)}" for key, values in diffs.items())
    return (
        f"NOT consistent: {world_size} ranks disagree on {', '.join(levers)} "
        f"({len(diffs)} getter{'s' if len(diffs) != 1 else ''}): {details}"
    )


# --- gathering -------------------------------------------------------------------------------

_UNREADABLE_KEY = "__speedflags_unreadable__"


def _to_json(value: Any) -> Any:
    if isinstance(value, Unreadable):
        return {_UNREADABLE_KEY: [value.error, value.message]}
    return str(value)


def _from_json(obj: Dict[str, Any]) -> Any:
    if len(obj) == 1 and _UNREADABLE_KEY in obj:
        error, message = obj[_UNREADABLE_KEY]
        return Unreadable(error, message)
    return obj


# The last gather's tensors, kept referenced from Python. Without this, gloo's worker thread
# may drop the last reference to one of them after the collective returned; freeing a tensor
# that Python created needs the GIL, and on PyTorch 2.4 destroy_process_group() joins that
# thread while holding the GIL: a deadlock (seen in `torchrun -m speedflags report`).
_keepalive: Tuple[Any, ...] = ()


def gather(obj: Any, group: Any = None) -> List[Any]:
    """Every rank's ``obj`` (JSON-friendly, :class:`Unreadable` allowed), in rank order.

    A collective over ``group``. Two ``all_gather`` calls: the sizes, then the JSON bytes
    padded to the longest. CPU tensors, except on an NCCL-only group (CUDA tensors on
    ``torch.cuda.current_device()``).
    """
    backend = str(_dist.get_backend(group))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    data = json.dumps(obj, default=_to_json).encode("utf-8")
    world_size = int(_dist.get_world_size(group))
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    _dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    chunks = [torch.empty_like(padded) for _ in range(world_size)]
    _dist.all_gather(chunks, padded, group=group)
    global _keepalive
    _keepalive = (size, sizes, padded, chunks)
    return [
        json.loads(bytes(chunk[:length].cpu().tolist()).decode("utf-8"), object_hook=_from_json)
        for chunk, length in zip(chunks, lengths)
    ]


# --- the check -------------------------------------------------------------------------------


class RankSnapshot(Dict[str, Any]):
    """The state every rank shares, as returned by :func:`check_ranks`: a ``dict``.

    It holds :func:`speedflags.snapshot`'s entries plus ``"numerics"`` (determinism flags
    that are not levers), and says how it was obtained. Scope: a read of the calling
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
    rank: Optional[int]
    world_size: int
    backend: Optional[str]
    reason: str

    def __init__(
        self,
        state: Dict[str, Any],
        *,
        checked: bool,
        rank: Optional[int],
        world_size: int,
        backend: Optional[str],
        reason: str,
    ) -> None:
        super().__init__(state)
        self.checked = checked
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.reason = reason


def _payload(state: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "torch": torch.__version__,
        "state": state,
    }


def _compare(payloads: Sequence[Dict[str, Any]]) -> Dict[str, Tuple[Any, ...]]:
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
        InvalidTypeError: ``group`` is not a process group.

    Example:
        >>> import speedflags
        >>> result = speedflags.check_ranks()
        >>> result.reason
        'no torch.distributed process group: nothing to compare'
    """
    if group is not None and (not AVAILABLE or not isinstance(group, _dist.ProcessGroup)):
        raise InvalidTypeError(
            f"check_ranks(group={group!r}): expected a torch.distributed ProcessGroup or None "
            "(None: the default group)"
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

    __slots__ = ("_lock", "_noted", "done", "group")

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.done = False
        self._noted = False
        self._lock = threading.Lock()

    def __call__(self, label: str, undo: Callable[[], None]) -> None:
        """Check once; if the check raises, call ``undo`` (close the frame) and re-raise."""
        if self.done:
            return
        with self._lock:
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
