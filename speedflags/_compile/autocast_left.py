"""The autocast state a failed compiled call leaves behind, found and put back.

PyTorch 2.1's dynamo enters a traced ``torch.autocast`` region for real while it traces (its
fake tensors then see the autocast state) and exits it only when tracing reaches the end of
the block. An error raised while it traces the block (a shape error its fake tensors meet,
an ``Unsupported`` under ``fullgraph=True``) leaves the caller's thread inside the region:
autocast enabled, its dtype, and ``torch.autocast``'s nesting counter one up, so that later
``torch.autocast`` exits no longer clear the cast cache. Plain ``torch.autocast`` in the
compiled function leaves it the same way there; PyTorch 2.2 and later exit it.

``@speedup(compile=...)`` (:mod:`.guarded`) and :func:`speedflags.guard_levers` run the
compiled call themselves: they read the thread's autocast state before it (:func:`held`) and,
when the call failed (it raised, or compiling failed and the call fell back), put back what
changed (:func:`put_back`), with a ``restore`` record on the ledger. A ``torch.compile`` of
the user's own, called directly, has no speedflags code around the call to notice it
(``docs/inside_compile.md``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .._ledger.ledger import ledger
from ..levers.registry import AUTOCAST_DEVICE_TYPES, autocast_lever

__all__ = ["held", "put_back"]

log = logging.getLogger("speedflags")

REASON = (
    "put back: compiling failed while tracing a torch.autocast region and left it entered "
    "in this thread (PyTorch 2.1's dynamo enters it for real while it traces)"
)

Held = tuple[tuple[Any, ...], int]


def held() -> Held:
    """The calling thread's autocast state now: each device type's (enabled, dtype), and
    ``torch.autocast``'s nesting counter (which has no getter: one up, then back, reads it).

    Example:
        >>> from speedflags._compile.autocast_left import held
        >>> held()[1]  # outside any torch.autocast
        0
    """
    states = tuple(autocast_lever(device_type).read() for device_type in AUTOCAST_DEVICE_TYPES)
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return states, int(level) - 1


def put_back(before: Held, label: str, where: tuple[str, int] | None) -> bool:
    """Bring the thread's autocast back to ``before`` (what :func:`held` read before a
    compiled call that failed) if it changed; record each device type put back. Returns
    whether anything had changed.

    Example:
        >>> from speedflags._compile.autocast_left import held, put_back
        >>> put_back(held(), "example", None)  # nothing changed: nothing to do
        False
    """
    now = held()
    if now == before:
        return False
    the_ledger = ledger()
    states, level = before
    notes = []
    with the_ledger.lock, the_ledger.section(label, where):
        for device_type, was, found in zip(AUTOCAST_DEVICE_TYPES, states, now[0], strict=True):
            if was == found:
                continue
            lever = autocast_lever(device_type)
            lever.restore(was, found)
            notes.append((lever, found, was))
        extra = now[1] - level
        for _ in range(max(extra, 0)):  # the region's exit: one down per region entered
            torch.autocast_decrement_nesting()
        if extra > 0:
            torch.clear_autocast_cache()
    for lever, found, was in notes:
        the_ledger.note(lever.name, "restore", REASON, before=lever.describe(found),
                        after=lever.describe(was), label=label, where=where)  # fmt: skip
    log.info("%s: %s (autocast nesting %d -> %d)", label, REASON, now[1], level)
    return True
