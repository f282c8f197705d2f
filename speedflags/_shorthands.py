"""The single-lever shorthands, made from the levers' declarations: ``tf32()``,
``matmul_precision()``, ``cudnn_benchmark()``, ``sdpa_backend()``, ``deterministic()``,
``reduced_precision_reduction()`` and ``autocast()``, each a :class:`~speedflags.FastMath`
for one lever with a label that names the call.

A lever declares its shorthand once (:class:`~speedflags.levers.spec.Shorthand`: its name,
its one parameter, its docstring); this module makes the function from that. Each takes
``fast_math``'s ``device=``, ``strict=`` and ``label=`` keywords, with their meaning.
Called inside a function given to ``torch.compile``, each returns what ``fast_math``
returns there (``speedflags._fast_math.in_graph``): ``autocast()`` a ``torch.autocast``.
``_shorthands.pyi`` is their typed face (what mypy and editors read), kept equal to the
declarations by ``tests/test_shorthands.py``, as ``LeverArgs`` is kept equal to the levers.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from ._fast_math import FastMath
from ._fast_math.in_graph import built_in_graph
from ._hardware import normalize_device
from ._short_repr import short_repr, type_name
from .errors import InvalidTypeError
from .levers import registry
from .levers._base import UNSET
from .levers.spec import LeverSpec

__all__ = ["MADE", "make_shorthand"]  # and each function of MADE, added below

_KEYWORDS = ("device", "strict", "label")
_OPTIONS_DOC = (
    "\n\n    Also takes ``device=``, ``strict=`` and ``label=``, as :func:`speedflags.fast_math` "
    "does\n    (the label defaults to the call, as written)."
)


def _signature(spec: LeverSpec) -> inspect.Signature:
    shorthand = spec.shorthand
    assert shorthand is not None  # noqa: S101 - only levers with one get here
    kind = (
        inspect.Parameter.VAR_POSITIONAL
        if shorthand.variadic
        else (inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    default = (
        inspect.Parameter.empty
        if shorthand.default is UNSET or shorthand.variadic
        else (shorthand.default)
    )
    params = [inspect.Parameter(shorthand.parameter, kind, default=default)]
    device_kind = (
        inspect.Parameter.POSITIONAL_OR_KEYWORD
        if shorthand.device_positional
        else inspect.Parameter.KEYWORD_ONLY
    )
    params.append(inspect.Parameter("device", device_kind, default=None))
    params.append(inspect.Parameter("strict", inspect.Parameter.KEYWORD_ONLY, default=False))
    params.append(inspect.Parameter("label", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params, return_annotation=FastMath)


def make_shorthand(spec: LeverSpec) -> Callable[..., FastMath]:
    """The single-lever function ``spec`` declares (``spec.shorthand``).

    Example:
        >>> from speedflags._shorthands import make_shorthand
        >>> from speedflags.levers.registry import lever_spec
        >>> make_shorthand(lever_spec("cudnn_benchmark"))(False).levers
        {'cudnn_benchmark': False}
    """
    shorthand = spec.shorthand
    if shorthand is None:
        raise InvalidTypeError(f"make_shorthand({spec.name}): the lever declares no shorthand")
    name, parameter = shorthand.name, shorthand.parameter
    signature = _signature(spec)

    def build(*args: Any, **kwargs: Any) -> FastMath:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:  # as Python words it for a function of this signature
            raise InvalidTypeError(f"{name}(): {exc}") from None
        bound.apply_defaults()
        given = bound.arguments[parameter]
        if shorthand.variadic:
            shown = [repr(value) for value in given]
            given = given[0] if len(given) == 1 else given
        else:
            shown = [repr(given)]
        spec.check(name, given, parameter)  # refused here, named as this call
        device, strict, label = (bound.arguments[key] for key in _KEYWORDS)
        if device is not None:
            shown.append(f"device={str(normalize_device(device, name))!r}")
        if label is not None and not isinstance(label, str):
            raise InvalidTypeError(
                f"{name}(label={short_repr(label)}): expected a str, got {type_name(label)}"
            )
        return FastMath(
            **{spec.name: given},
            device=device,
            strict=strict,
            label=label if label is not None else f"{name}({', '.join(shown)})",
        )

    build.__name__ = build.__qualname__ = name
    first, _, rest = inspect.cleandoc(shorthand.doc).partition("\n")
    build.__doc__ = first + "\n" + textwrap.indent(rest, "    ") + _OPTIONS_DOC
    build.__signature__ = signature  # type: ignore[attr-defined]
    build.__module__ = __name__
    return built_in_graph(build)


# one function per built-in lever that declares a shorthand, by the shorthand's name
MADE: dict[str, Callable[..., FastMath]] = {
    spec.shorthand.name: make_shorthand(spec)
    for spec in registry.REGISTRY
    if spec.builtin and spec.shorthand is not None
}
globals().update(MADE)
__all__ += sorted(MADE)
