"""A lever's declaration: :class:`LeverSpec`, everything the rest of speedflags knows of one
lever, written once in the lever's own module with :func:`declare`.

``fast_math``'s keywords, the registry, the snapshot, the shorthands, the report's rows,
``tune``'s candidates, ``verify``'s list, the leak plugin and the rank check all read the
declarations (:mod:`speedflags.levers.registry` collects them); a library declares its own
lever the same way with :func:`speedflags.register_lever`.

Example:
    >>> from speedflags.levers.registry import lever_spec
    >>> spec = lever_spec("cudnn_benchmark")
    >>> spec.scope, spec.shorthand.name, spec.baseline, spec.candidates
    ('process', 'cudnn_benchmark', False, (True,))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, get_type_hints

from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from ._base import UNSET, DeviceLever, Effect, Scope

if TYPE_CHECKING:
    import torch

__all__ = ["MATMUL_OPS", "ON_OFF", "LeverSpec", "Shorthand", "declare"]

# matmuls (mm, addmm, bmm, ...), convolutions, recurrent layers and attention: the kernels
# TF32, matmul precision, autocast and param_dtype change
MATMUL_OPS = ("mm", "matmul", "linear", "einsum", "conv", "lstm", "gru", "rnn", "scaled_dot")

# What every on/off lever declares alike (tf32, cudnn_benchmark, reduced_precision_reduction):
# True or False, off is plain eager's, and tune tries on. Written once, so the three cannot
# drift apart: ``declare(lever, **ON_OFF, ...)``.
ON_OFF: Mapping[str, Any] = MappingProxyType(
    {"values": "True or False", "baseline": False, "candidates": (True,)}
)


@dataclass(frozen=True)
class Shorthand:
    """The single-lever function a lever gets (``speedflags.sdpa_backend("flash")``).

    Each shorthand also takes ``fast_math``'s ``device=``, ``strict=`` and ``label=``
    keywords (``autocast`` takes ``device`` positionally too); its label names the call
    (``"sdpa_backend('flash', 'math')"``). ``speedflags/_shorthands.pyi`` is their typed
    face, kept equal to these declarations by a test.

    Attributes:
        name: its public name.
        parameter: the name of its one positional parameter (``"enabled"``).
        doc: its docstring (with an example; the function's scope and what it restores).
        default: that parameter's default (``UNSET``: required).
        variadic: the parameter is ``*backends`` (every positional argument, as a tuple).
        device_positional: ``device`` may also be given positionally, after the parameter.
    """

    name: str
    parameter: str
    doc: str
    default: Any = UNSET
    variadic: bool = False
    device_positional: bool = False


@dataclass(frozen=True)
class LeverSpec:
    """One lever, as every part of speedflags sees it.

    Attributes:
        name: the ``fast_math`` keyword (``"tf32"``); also ``Lever.name`` and the one name
            the lever goes by everywhere else: the ledger's history (speedflags' own writes
            and, under ``watch``, everyone else's), snapshots, warnings and the leak report.
        scope: ``"process"`` (C++-global flags), ``"thread"`` (autocast) or ``"model"``
            (the model levers, given with ``model=``: their state is one model's).
        values: the accepted values, in words (for errors and help).
        validate: normalises a value or raises ``InvalidValueError`` / ``InvalidTypeError``
            saying what is wrong (without saying where: :meth:`check` adds that).
        make: the :class:`~speedflags.levers._base.DeviceLever` that reads, writes and
            describes the state: per device type (process levers ignore it), or per model.
        summary: what the lever switches, one line.
        accuracy: what it costs in accuracy, one line.
        order: where it is applied among the levers of one frame (smaller first: TF32
            before matmul precision, which share a state; autocast after the flags).
        annotation: the keyword's type, for ``fast_math``'s run-time signature (from
            :class:`~speedflags.levers.arguments.LeverArgs`, what type checkers read).
        shorthand: its single-lever function (None: it has none).
        baseline: the value that means "off" (plain fp32 eager); ``UNSET`` when the lever
            has no off value (the SDPA dispatcher's default is every backend).
        candidates: the values ``tune`` tries, in order.
        ops: words in the names of the torch functions whose kernels the lever changes
            (``"conv"``); ``tune`` skips the lever for a step that calls none of them.
            Empty: any step.
        dynamo_misses: the part of the lever's state that ``torch.compile`` does not guard
            on some supported PyTorch, in words (empty: dynamo guards all of it). A graph
            traced under one state of such a lever would serve another, so compiled
            callables read these levers themselves (``docs/compile.md``).
        effect_of: whether a value has an effect on a device (a lever made per model
            answers without a model); default: the lever's own ``available``.
        describe: a value in JSON-friendly words without a lever at hand (default: the
            lever's ``describe_value``).
        builtin: declared by speedflags (a registered lever is not).
        domain: the state its lever writes (``Lever.domain``); for a lever made per device
            type or per model, the stem of their domains (``"amp"``: ``"amp:cuda"``). The
            lever owns the domain and every ``"<domain>:..."`` under it: no other lever may
            write them (:meth:`owns_domain`).
    """

    name: str
    scope: Scope
    values: str
    validate: Callable[[object], Any]
    make: Callable[[Any], DeviceLever]
    summary: str
    accuracy: str
    order: int
    annotation: Any = Any
    shorthand: Shorthand | None = None
    baseline: Any = UNSET
    candidates: tuple[Any, ...] = ()
    ops: tuple[str, ...] = ()
    dynamo_misses: str = ""
    effect_of: Callable[[Any, torch.device], Effect] | None = None
    describe: Callable[[Any], Any] | None = None
    builtin: bool = True
    domain: str = ""

    def lever(self, device_type: str = "cpu", model: Any = None) -> DeviceLever:
        """The lever object for ``device_type`` (one shared instance per type), or for
        ``model`` (a model lever: one instance per model)."""
        if self.scope == "model":
            if model is None:
                raise InvalidValueError(f"{self.name}: a model lever needs model=")
            return self.make(model)
        return self.make(device_type)

    def owns_domain(self, domain: str) -> bool:
        """Whether ``domain`` is one of its lever's: its domain, or one under it.

        Example:
            >>> from speedflags.levers.registry import lever_spec
            >>> amp = lever_spec("amp")
            >>> amp.owns_domain("amp:cuda"), amp.owns_domain("amp:xla"), amp.owns_domain("ample")
            (True, True, False)
        """
        return domain == self.domain or domain.startswith(f"{self.domain}:")

    @property
    def per_model(self) -> bool:
        """Whether this is a model lever (given with ``model=``; no process-wide state)."""
        return self.scope == "model"

    @property
    def has_baseline(self) -> bool:
        """Whether the lever has an "off" value (plain fp32 eager)."""
        return self.baseline is not UNSET

    def check(self, call: str, value: object, argument: str | None = None) -> Any:
        """``validate`` with the error saying where: ``"fast_math(amp='bf17'): ..."``."""
        shown = argument or self.name
        try:
            return self.validate(value)
        except InvalidValueError as exc:
            raise InvalidValueError(f"{call}({shown}={short_repr(value)}): {exc}") from None
        except InvalidTypeError as exc:
            raise InvalidTypeError(f"{call}({shown}={short_repr(value)}): {exc}") from None

    def effect(self, value: Any, device: torch.device) -> Effect:
        """Whether ``value`` (validated) has an effect on ``device``, and why (not)."""
        if self.effect_of is not None:
            return self.effect_of(value, device)
        available = getattr(self.lever(device.type), "available", None)
        return Effect(True, "") if available is None else available(value, device)

    def describe_value(self, value: Any) -> Any:
        """A JSON-friendly view of a validated value (``torch.bfloat16`` -> ``"bfloat16"``)."""
        if self.describe is not None:
            return self.describe(value)
        return self.lever().describe_value(value)

    def current(self, device_type: str = "cpu") -> Any:
        """The lever's torch state now, described (never raises; a model lever has no state
        outside a model: ``None``)."""
        if self.per_model:
            return None
        lever = self.lever(device_type)
        return lever.describe(lever.read())


def declare(
    lever: Any,
    *,
    name: str | None = None,
    scope: Scope | None = None,
    validate: Callable[[object], Any] | None = None,
    **declared: Any,
) -> LeverSpec:
    """A built-in lever's declaration, written in its module as ``DECLARED = (declare(...),)``.

    ``lever`` is the lever itself (one instance: its ``name``, ``scope``, ``domain`` and
    ``validate`` are read from it), or a factory per device type or per model (then
    ``name``, ``scope`` and ``validate`` are given, and the levers' domains are
    ``"<name>:<device type or model>"``). ``declared`` are the other fields of :class:`LeverSpec`,
    by name: ``order``, ``values``, ``summary`` and ``accuracy`` always; ``shorthand``,
    ``baseline``, ``candidates``, ``ops``, ``dynamo_misses``, ``effect_of`` and ``describe``
    where the lever has them (an on/off lever gives ``**ON_OFF`` for ``values``, ``baseline``
    and ``candidates``). The keyword's type comes from
    :class:`~speedflags.levers.arguments.LeverArgs`.

    Example:
        >>> from speedflags.levers.cudnn import DECLARED
        >>> DECLARED[0].name, DECLARED[0].order
        ('cudnn_benchmark', 30)
    """
    from .arguments import LeverArgs  # the static typed face: one type per built-in lever

    if callable(lever) and not hasattr(lever, "read"):  # a factory
        if name is None or scope is None or validate is None:
            raise TypeError("declare(factory, ...): a factory's lever needs name, scope, validate")
        make = lever
        domain = name
    else:
        instance = lever
        name = name or instance.name
        scope = scope or instance.scope
        validate = validate or instance.validate
        domain = instance.domain

        def make(_key: Any) -> DeviceLever:
            return instance  # type: ignore[no-any-return]

    declared.update(annotation=get_type_hints(LeverArgs).get(name, Any), domain=domain)
    return LeverSpec(name=name, scope=scope, validate=validate, make=make, **declared)
