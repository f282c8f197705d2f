"""The state of the levers ``torch.compile`` does not guard, read once per compiled call.

Dynamo re-traces a frame when grad mode, autocast, deterministic algorithms and (on recent
PyTorch) cuBLAS TF32 change, but not when the SDPA kernels or their order, cuDNN's flags,
oneDNN's fp32 precision or fp16 accumulation change: a graph traced under one state of those
would serve another (``docs/compile.md``). Which levers those are is the registry's word
(:attr:`~speedflags.levers.registry.LeverSpec.dynamo_misses`), not a list kept here.

:func:`lever_state` is what a guarded compiled call reads before it runs: every such lever's
own ``read()``, one per piece of torch state (``tf32`` and ``matmul_precision`` share one), in
a tuple that compares equal exactly when the state is the same. It costs a few microseconds
(measured in ``benchmarks/test_compile_levers.py``; ``benchmarks/RESULTS.md``).

The list follows the registry: a lever registered with ``dynamo_misses``
(:func:`speedflags.register_lever`) joins it.

Example:
    >>> from speedflags._compile.lever_state import describe_state, lever_state, unguarded
    >>> [spec.name for spec in unguarded()]  # doctest: +NORMALIZE_WHITESPACE
    ['tf32', 'matmul_precision', 'cudnn_benchmark', 'sdpa', 'deterministic',
     'reduced_precision_reduction']
    >>> lever_state() == lever_state()
    True
    >>> describe_state(lever_state())["cudnn_benchmark"]
    False
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ..levers import registry
from ..levers._base import Lever
from ..levers.registry import LeverSpec

__all__ = ["LeverState", "describe_state", "lever_state", "unguarded"]

LeverState = tuple[Hashable, ...]
Domains = tuple[tuple[Callable[[], Hashable], tuple[tuple[str, Lever], ...]], ...]


def unguarded() -> tuple[LeverSpec, ...]:
    """The levers whose state dynamo does not (fully) guard, in registry order."""
    return tuple(spec for spec in registry.REGISTRY if spec.dynamo_misses)


def _by_domain() -> Domains:
    # One read per piece of torch state: tf32 and matmul_precision share the fp32 precision.
    reads: dict[str, Callable[[], Hashable]] = {}
    levers: dict[str, list[tuple[str, Lever]]] = {}
    for spec in unguarded():
        lever = spec.lever()
        reads.setdefault(lever.domain, lever.read)
        levers.setdefault(lever.domain, []).append((spec.name, lever))
    return tuple((read, tuple(levers[domain])) for domain, read in reads.items())


# (registry version, domains, their reads): derived again when a lever is (un)registered
_derived: tuple[int, Domains, tuple[Callable[[], Hashable], ...]] = (-1, (), ())


def _domains() -> tuple[Domains, tuple[Callable[[], Hashable], ...]]:
    global _derived
    derived = _derived
    if derived[0] != registry.version:
        domains = _by_domain()
        derived = _derived = (registry.version, domains, tuple(read for read, _ in domains))
    return derived[1], derived[2]


def lever_state() -> LeverState:
    """The state of every lever dynamo does not guard, now: equal when nothing changed."""
    return tuple([read() for read in _domains()[1]])


def describe_state(state: LeverState) -> dict[str, Any]:
    """A JSON-friendly view of a :func:`lever_state`, by lever name (for ``.stats``)."""
    out: dict[str, Any] = {}
    for (_, levers), value in zip(_domains()[0], state, strict=True):
        for name, lever in levers:
            out[name] = lever.describe(value)
    return out
