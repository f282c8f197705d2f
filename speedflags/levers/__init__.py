"""The levers: one module per lever, and the registry every other part of speedflags reads.

:mod:`speedflags.levers.registry` holds one :class:`~speedflags.levers.registry.LeverSpec`
per lever, in application order. Adding a lever means one module with its ``Lever`` class
and one registry entry. :mod:`.culprits` is the hook through which a running
:func:`speedflags.watch` tells the levers (and the ledger) who wrote a flag.

:mod:`._base` also holds ``UNSET``, the registry's "no value" where ``None`` is a value (a
lever's baseline). It is not public: a user leaves a lever unchanged with ``None`` or by
leaving its keyword out.

May import: torch and the base modules (``errors``, ``hardware``, ``_short_repr``,
``_warn``) only. The levers are the lowest layer: the ledger, the watch and
everything else build on them.
"""

from __future__ import annotations

from ._base import Effect, Lever, Unreadable
from .registry import (
    LEVER_NAMES,
    PROCESS_LEVERS,
    REGISTRY,
    LeverSpec,
    autocast_lever,
    check_levers,
    lever_spec,
)

__all__ = [
    "LEVER_NAMES",
    "PROCESS_LEVERS",
    "REGISTRY",
    "Effect",
    "Lever",
    "LeverSpec",
    "Unreadable",
    "autocast_lever",
    "check_levers",
    "lever_spec",
]
