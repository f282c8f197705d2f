"""What ranks compare, and how a difference between them reads.

Pure comparison of JSON-friendly states; the exchange is :mod:`speedflags._distributed.exchange`
and the check that raises is :func:`speedflags.check_ranks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._status import snapshot
from ..levers.guarded import GUARDED

# guarded settings each rank may hold its own value of
PER_RANK = tuple(s.name for s in GUARDED if not s.ranks_agree)


def rank_state() -> dict[str, Any]:
    """What ranks must agree on: :func:`speedflags.snapshot`, every lever (deterministic mode
    and cuBLAS's reduced-precision reductions among them) and every guarded setting, less
    those each rank may hold its own value of (the default device, the thread count, the
    calling thread's grad mode and autocast cache and depth). Never raises.
    """
    state = snapshot()
    for name in PER_RANK:
        state.pop(name, None)
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


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"tf32": {"getter": v}}`` -> ``{"tf32.getter": v}`` (the keys users see)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def differences(states: Sequence[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Each flattened getter whose value is not the same on every rank: its value per rank."""
    flat = [flatten(state) for state in states]
    keys: list[str] = []
    for one in flat:
        keys += [key for key in one if key not in keys]
    out: dict[str, tuple[Any, ...]] = {}
    for key in keys:
        values = tuple(one.get(key, ABSENT) for one in flat)
        if any(value != values[0] for value in values[1:]):
            out[key] = values
    return out


def _ranges(ranks: Sequence[int]) -> str:
    parts: list[str] = []
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
    groups: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in groups:
            if seen == value:
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return "; ".join(f"{value!r} on {_ranges(ranks)}" for value, ranks in groups)


def levers_of(diffs: dict[str, tuple[Any, ...]]) -> tuple[str, ...]:
    """The top-level names (``"tf32"``, ``"default_dtype"``, ``"torch"``) of differing getters."""
    out: list[str] = []
    for key in diffs:
        lever = key.split(".", 1)[0]
        if lever not in out:
            out.append(lever)
    return tuple(out)


def verdict(diffs: dict[str, tuple[Any, ...]], world_size: int) -> str:
    """One line: whether the ranks agree, and where they do not."""
    if not diffs:
        return f"consistent: all {world_size} ranks run with the same flags"
    levers = levers_of(diffs)
    details = "; ".join(f"{key}: {describe_values(values)}" for key, values in diffs.items())
    return (
        f"NOT consistent: {world_size} ranks disagree on {', '.join(levers)} "
        f"({len(diffs)} getter{'s' if len(diffs) != 1 else ''}): {details}"
    )
