"""Lever sets built from the registry: every lever's "off" value, a set of levers on top of
them, every lever's state now, and the keyword list of ``fast_math`` and ``@speedup``.

The bench and ``tune`` measure against :func:`baseline_levers` (plain fp32 eager, every
lever with an off value off), ``verify`` and ``tune`` run a candidate on top of it
(:func:`with_baseline`), and :func:`speedflags.snapshot` is :func:`lever_snapshot`.

Example:
    >>> from speedflags.levers.lever_sets import baseline_levers
    >>> sorted(baseline_levers())[:3]
    ['amp', 'cudnn_benchmark', 'deterministic']
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidValueError

# by its module: the registry is read when called (a test extends it for its duration)
from . import registry
from .registry import AUTOCAST_DEVICE_TYPES

__all__ = ["baseline_levers", "document_levers", "lever_snapshot", "with_baseline"]


def baseline_levers() -> dict[str, Any]:
    """Every lever's "off" value: plain fp32 eager (the bench and ``tune`` reference).

    Example:
        >>> from speedflags.levers.lever_sets import baseline_levers
        >>> baseline_levers()  # doctest: +NORMALIZE_WHITESPACE
        {'tf32': False, 'matmul_precision': 'highest', 'cudnn_benchmark': False,
         'deterministic': False, 'reduced_precision_reduction': False, 'amp': False}
    """
    return {
        spec.name: spec.baseline
        for spec in registry.specs()
        if spec.has_baseline and not spec.per_model
    }


def with_baseline(levers: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``levers`` on top of every other lever's "off" value, as one ``fast_math`` call.

    An off value that would contradict a candidate (``tf32=False`` beside
    ``matmul_precision='medium'``, which turns cuBLAS TF32 on) is left out.

    Example:
        >>> from speedflags.levers.lever_sets import with_baseline
        >>> with_baseline((("matmul_precision", "medium"),))  # doctest: +NORMALIZE_WHITESPACE
        {'matmul_precision': 'medium', 'cudnn_benchmark': False, 'deterministic': False,
         'reduced_precision_reduction': False, 'amp': False}
    """
    merged: dict[str, Any] = dict(levers)
    for name, value in baseline_levers().items():
        if name in merged:
            continue
        try:
            registry.check_levers("with_baseline", {**merged, name: value})
        except InvalidValueError:
            continue
        merged[name] = value
    return {spec.name: merged[spec.name] for spec in registry.specs() if spec.name in merged}


def lever_snapshot(device_types: Sequence[str] = AUTOCAST_DEVICE_TYPES) -> dict[str, Any]:
    """Every lever's state now, described, by ``fast_math`` keyword. Never raises.

    Thread-scope levers (``amp``) are described per device type, for the calling thread.
    Model levers have no state outside a model and are left out.
    """
    out: dict[str, Any] = {}
    for spec in registry.specs():
        if spec.per_model:
            continue
        if spec.scope == "thread":
            out[spec.name] = {dt: spec.current(dt) for dt in device_types}
        else:
            out[spec.name] = spec.current()
    return out


def document_levers(func: Callable[..., Any]) -> None:
    """Give ``func`` (which takes ``**levers``) one keyword per lever in its signature and
    a "Levers:" section in its docstring (the ``{levers}`` placeholder), from the registry.

    So ``help(speedflags.fast_math)``, IDEs and ``inspect.signature`` show every lever,
    while the lever list itself lives only here.
    """
    signature = inspect.signature(func)
    given = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    levers = [
        inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=spec.annotation)
        for spec in registry.REGISTRY
    ]  # fmt: skip
    # the levers first among the keyword-only arguments, as users write them
    first = next((i for i, p in enumerate(given) if p.kind is p.KEYWORD_ONLY), len(given))
    params = given[:first] + levers + given[first:]
    func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    if func.__doc__ and "{levers}" in func.__doc__:
        # The entries go one level under the placeholder's own indentation, which Python 3.13
        # strips from docstrings at compile time and older Pythons keep.
        def entries(placeholder: re.Match[str]) -> str:
            indent = placeholder.group(1) + "    "
            lines = []
            for spec in registry.REGISTRY:
                lines.append(f"{indent}{spec.name}: {spec.summary}. Accepts {spec.values}.")
                lines.append(f"{indent}    Scope: {spec.scope}. Accuracy: {spec.accuracy}.")
            return "\n".join(lines)

        func.__doc__ = re.sub(r"^([ \t]*)\{levers\}$", entries, func.__doc__, flags=re.MULTILINE)
