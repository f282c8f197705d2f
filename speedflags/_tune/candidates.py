"""What ``tune`` tries: the registry's candidates that can matter for this step on this device.

A candidate is skipped, with the reason kept in its row, when the lever has no effect on
the device or this PyTorch refuses it (``Lever.available``; ``matmul_precision="medium"`` on
a CPU as tried: :func:`speedflags._measure.route.effect_here`), in the words of
:mod:`speedflags._measure.vocabulary`; one that runs emulated (bf16 autocast on a CPU without
bf16 instructions) is not raced either, but its row says so, and the search times it once
so that the table shows what it costs; or when the step never calls a torch
function whose kernels the lever changes (``LeverSpec.ops``: no attention for ``sdpa``,
no convolution for ``cudnn_benchmark``), as recorded by a ``TorchFunctionMode`` during the
fp32 reference call. Skipping those is not only quicker: a lever without effect can only
look faster by chance, and every candidate timed is one more chance for that.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._measure.lever_files import plain_levers
from .._measure.route import effect_here
from .._measure.verdicts import recorded
from .._measure.vocabulary import EMULATED, IN_EFFECT, status_of
from ..errors import InvalidValueError
from ..levers import registry
from ..levers.registry import check_levers
from .result import Row

__all__ = ["Levers", "calls_of", "candidates", "combinations", "verdicts_of"]

Levers = tuple[tuple[str, Any], ...]
MAX_COMBINATIONS = 16


def calls_of(step: Callable[[], Any]) -> tuple[Any, frozenset[str] | None]:
    """Run ``step()``; return its result and the names of the torch functions it called.

    The names are ``None`` when they cannot be recorded (a PyTorch without
    ``TorchFunctionMode``, or a step that fails under one: it is then run again plainly).

    Example:
        >>> import torch
        >>> from speedflags._tune.candidates import calls_of
        >>> out, names = calls_of(lambda: torch.nn.Linear(2, 2)(torch.ones(1, 2)).relu())
        >>> sorted(names & {"linear", "relu", "conv2d"})
        ['linear', 'relu']
    """
    mode_class = getattr(torch.overrides, "TorchFunctionMode", None)
    if mode_class is None:  # pragma: no cover - PyTorch < 1.13
        return step(), None
    names: set[str] = set()

    class Recorder(mode_class):  # type: ignore[misc, valid-type]
        def __torch_function__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
        ) -> Any:
            names.add(str(getattr(func, "__name__", func)).lower())
            return func(*args, **(kwargs or {}))

    try:
        with Recorder():
            out = step()
    except Exception:
        return step(), None
    return out, frozenset(names)


def _calls_none(ops: Sequence[str], calls: frozenset[str] | None) -> bool:
    if not ops or calls is None:
        return False
    return not any(word in name for name in calls for word in ops)


def candidates(
    device: torch.device,
    wanted: Mapping[str, Sequence[Any]] | None = None,
    calls: frozenset[str] | None = None,
    model: bool = False,
) -> tuple[list[Levers], list[Row]]:
    """The single-lever candidates for ``device``, and rows for those skipped, with why.

    ``wanted`` maps lever names to the values to try (default: every lever's registry
    ``candidates``); ``calls`` are the torch functions the step calls (``None``: unknown);
    ``model``: a model was given, so the model levers are candidates too (without one, a
    model lever named in ``wanted`` gets a row saying why it was not tried).

    Example:
        >>> import torch
        >>> from speedflags._tune.candidates import candidates
        >>> wanted = {"tf32": [True], "sdpa": ["flash"]}
        >>> calls = frozenset({"linear", "scaled_dot_product_attention"})
        >>> tried, skipped = candidates(torch.device("cpu"), wanted, calls=calls)
        >>> tried, [row.levers for row in skipped]
        ([(('sdpa', ('flash',)),)], [{'tf32': True}])
        >>> tried, skipped = candidates(torch.device("cpu"), wanted, calls=frozenset({"linear"}))
        >>> tried, skipped[1].note
        ([], 'skipped (not called): the step calls no scaled_dot_product function')
    """
    tried: list[Levers] = []
    skipped: list[Row] = []
    for spec in registry.specs():
        if wanted is not None and spec.name not in wanted:
            continue
        values = spec.candidates if wanted is None else wanted[spec.name]
        if spec.per_model and not model:
            if wanted is not None:  # asked for by name: say why it was not tried
                note = "skipped (no model): give tune(..., model=net) to try it"
                skipped.extend(
                    Row(plain_levers(((spec.name, spec.check("tune", raw)),)), note=note)
                    for raw in values
                )
            continue
        for raw in values:
            value = spec.check("tune", raw, f"levers[{spec.name!r}]")
            levers: Levers = ((spec.name, value),)
            effect = effect_here(spec.name, value, device)  # "medium" on a CPU: as measured
            status = status_of(effect)
            if status not in (IN_EFFECT, EMULATED):
                note = f"skipped ({status}): {effect.reason}"
                skipped.append(Row(plain_levers(levers), note=note, verdict=status))
            elif _calls_none(spec.ops, calls):
                functions = "/".join(spec.ops)
                note = f"skipped (not called): the step calls no {functions} function"
                skipped.append(Row(plain_levers(levers), note=note))
            elif status == EMULATED:  # timed once by the search, never raced
                note = f"{EMULATED}: {effect.reason}"
                skipped.append(Row(plain_levers(levers), note=note, verdict=EMULATED))
            else:
                tried.append(levers)
    return tried, skipped


def combinations(accepted: Sequence[tuple[Levers, float]]) -> list[Levers]:
    """Every combination (two levers or more) of the accepted single levers.

    ``accepted`` pairs each single lever with its speedup; of several values of one lever
    only the fastest is combined, and contradictory sets (``tf32=True`` with
    ``matmul_precision='highest'``) are left out. At most 16, fewest levers first.

    Example:
        >>> from speedflags._tune.candidates import combinations
        >>> combinations([((("amp", "bf16"),), 1.7), ((("matmul_precision", "medium"),), 1.3),
        ...               ((("matmul_precision", "high"),), 1.1)])
        [(('matmul_precision', 'medium'), ('amp', torch.bfloat16))]
    """
    fastest: dict[str, tuple[str, Any]] = {}
    for levers, _ in sorted(accepted, key=lambda pair: -pair[1]):
        fastest.setdefault(levers[0][0], levers[0])
    found: list[Levers] = []
    for size in range(2, len(fastest) + 1):
        for combo in itertools.combinations(fastest.values(), size):
            try:
                found.append(check_levers("tune", dict(combo)))
            except InvalidValueError:  # contradictory (tf32 against matmul precision)
                continue
    return found[:MAX_COMBINATIONS]


def can_compile() -> bool:
    """Whether this PyTorch and platform can run ``torch.compile`` (dynamo) at all."""
    is_supported = getattr(getattr(torch, "_dynamo", None), "is_dynamo_supported", None)
    try:
        return bool(is_supported()) if is_supported is not None else hasattr(torch, "compile")
    except Exception:
        return False


def verdicts_of(device: torch.device, rows: Sequence[Row]) -> dict[str, str]:
    """Whether each lever value ``tune`` timed takes effect on ``device`` (``verify``'s
    verdicts, ``{"amp='bf16'": "verified: ..."}``); never raises.

    Example:
        >>> import torch
        >>> from speedflags._tune.candidates import verdicts_of
        >>> from speedflags._tune.result import Row
        >>> found = verdicts_of(torch.device("cpu"), [Row({"tf32": True}, speedup=1.0)])
        >>> sorted(found), found["tf32=True"][:15]
        (['baseline (every lever off)', 'tf32=True'], 'no effect here:')
    """
    levers: dict[str, list[Any]] = {}
    for row in rows:
        if row.speedup is None:
            continue
        for name, value in row.levers.items():
            values = levers.setdefault(name, [])
            if value not in values:
                values.append(value)
    return recorded(device, levers) if levers else {}
