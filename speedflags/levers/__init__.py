"""The levers: one module per lever, each declaring its levers once, and the registry every
other part of speedflags reads.

Each built-in lever module (``precision``, ``cudnn``, ``sdpa``, ``deterministic``,
``reductions``, ``autocast``, ``param_dtype``, ``memory_format``, ``fp8``) implements the
protocol of ``_base`` and declares its levers (``DECLARED``,
:func:`~speedflags.levers.spec.declare`); :mod:`.registry` lists those modules
(``BUILT_IN_MODULES``) and collects the declarations.
Adding a built-in lever means one module, its line in that list, and its type in
:class:`~speedflags.levers.arguments.LeverArgs`. Levers of one's own (:mod:`.own`) join the
registry through :func:`speedflags.lever` and :func:`speedflags.register_lever`, and those
installed packages declare through the entry-point group ``speedflags.levers``
(:mod:`.installed`). :mod:`.culprits` is the hook through which a running
:func:`speedflags.watch` tells the levers (and the ledger) who wrote a flag.

``REGISTRY``, ``LEVER_NAMES`` and ``PROCESS_LEVERS`` are read from the registry when asked
for: a lever registered later is in them, and so are the installed ones.

:mod:`._base` also holds ``UNSET``, the registry's "no value" where ``None`` is a value (a
lever's baseline). It is not public: a user leaves a lever unchanged with ``None`` or by
leaving its keyword out.

May import: torch and the base modules (``errors``, ``hardware``, ``_short_repr``,
``_warn``, ``_tracing``) only. The levers are the lowest layer: the ledger, the watch and
everything else build on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import registry
from ._base import Effect, Lever, Unreadable

if TYPE_CHECKING:
    from .own import FunctionLever

from .registry import (
    LeverSpec,
    autocast_lever,
    check_levers,
    lever_spec,
    register_lever,
    unregister_lever,
)

__all__ = [
    "LEVER_NAMES",
    "PROCESS_LEVERS",
    "REGISTRY",
    "Effect",
    "FunctionLever",
    "Lever",
    "LeverSpec",
    "Unreadable",
    "autocast_lever",
    "check_levers",
    "lever_spec",
    "register_lever",
    "unregister_lever",
]

_FROM_REGISTRY = ("LEVER_NAMES", "PROCESS_LEVERS", "REGISTRY")


def __getattr__(name: str) -> Any:
    # the registry's current lists (PEP 562): a lever registered after import is in them,
    # and so are those installed packages declare
    if name in _FROM_REGISTRY:
        registry.load_installed()
        return getattr(registry, name)
    if name == "FunctionLever":  # loaded by the first lever of one's own
        from .own import FunctionLever

        return FunctionLever
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
