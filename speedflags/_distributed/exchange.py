"""Talking to the other ranks: this process's rank, its process group, and a gather.

The states travel as JSON through ``torch.distributed.all_gather``, with the group's own
backend (gloo on CPUs, NCCL on GPUs): ``all_gather_object`` would need NumPy (it converts
through ``Tensor.numpy()`` on 2.4 to 2.15), which neither PyTorch nor speedflags depends on,
and JSON needs no unpickling of what other processes sent.

Ledger records carry the rank of the process that made them (``FlagRecord.rank``); importing
this module installs :func:`current_rank` as the ledger's source, read once per frame from a
value cached per process group.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._ledger import history
from ..levers._base import Unreadable

_dist: Any = torch.distributed
# Feature detection: some builds (and old macOS/Windows wheels) have no torch.distributed.
AVAILABLE: bool = bool(_dist.is_available())
_GroupMember: Any = _dist.GroupMember if AVAILABLE else None

# --- the rank, for ledger records ------------------------------------------------------------


def _dead() -> None:
    return None


# (weak reference to the default process group, this process's rank in it). Weak: holding
# the group would keep it alive after destroy_process_group().
_cached: tuple[Callable[[], Any], int | None] = (_dead, None)


def current_rank() -> int | None:
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
    history.set_rank_source(current_rank)


def process_group(group: Any = None) -> tuple[int, int, str] | None:
    """``(rank, world size, backend)`` of ``group`` (default: the default group), or None.

    None when there is no initialised process group or this process is not in ``group``.
    """
    if not AVAILABLE or not _dist.is_initialized():
        return None
    rank = int(_dist.get_rank(group))
    if rank < 0:
        return None
    return rank, int(_dist.get_world_size(group)), str(_dist.get_backend(group))


# --- gathering -------------------------------------------------------------------------------

_UNREADABLE_KEY = "__speedflags_unreadable__"


def _to_json(value: Any) -> Any:
    if isinstance(value, Unreadable):
        return {_UNREADABLE_KEY: [value.error, value.message]}
    return str(value)


def _from_json(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and _UNREADABLE_KEY in obj:
        error, message = obj[_UNREADABLE_KEY]
        return Unreadable(error, message)
    return obj


# The last gather's tensors, kept referenced from Python. Without this, gloo's worker thread
# may drop the last reference to one of them after the collective returned; freeing a tensor
# that Python created needs the GIL, and on PyTorch 2.4 destroy_process_group() joins that
# thread while holding the GIL: a deadlock (seen in `torchrun -m speedflags report`).
_keepalive: tuple[Any, ...] = ()


def gather(obj: Any, group: Any = None) -> list[Any]:
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
        for chunk, length in zip(chunks, lengths, strict=True)
    ]
