"""The levers: one module per lever, and the registry every other part of speedflags reads.

:mod:`speedflags.levers.registry` holds one :class:`~speedflags.levers.registry.LeverSpec`
per lever, in application order. Adding a lever means one module with its ``Lever`` class
and one registry entry.
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
