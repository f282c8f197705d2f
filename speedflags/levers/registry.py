"""The lever registry: the one list of levers that everything else reads, collected from the
levers' own declarations.

Each lever module declares its levers once (``DECLARED``, made with
:func:`~speedflags.levers.spec.declare`): name, scope, values and their validation, effect
per device, words, shorthand. This module finds them (every module of ``speedflags.levers``
that is not part of the machinery), orders them by their ``order`` (the order a frame
applies them in) and keeps :data:`REGISTRY`; ``fast_math``, ``@speedup``, ``Schedule``, the
report, the bench configurations, the rank check, ``watch``, the pytest plugin, the
integrations and ``tune`` all derive their lever lists from it. A library adds a lever of its
own with :func:`register_lever` (and takes it back with :func:`unregister_lever`): the
registry is then rebuilt, so read it as ``registry.REGISTRY`` (or through :func:`specs`)
when it is used, not once at import.

Example:
    >>> from speedflags.levers.registry import LEVER_NAMES, lever_spec
    >>> LEVER_NAMES  # doctest: +NORMALIZE_WHITESPACE
    ('tf32', 'matmul_precision', 'cudnn_benchmark', 'sdpa', 'deterministic',
     'reduced_precision_reduction', 'amp', 'param_dtype', 'memory_format')
    >>> spec = lever_spec("amp")
    >>> spec.shorthand.name, spec.scope, spec.check("fast_math", "bf16")
    ('autocast', 'thread', torch.bfloat16)
"""

from __future__ import annotations

import importlib
import keyword
import pkgutil
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from ._base import UNSET, DeviceLever, Effect
from ._model_state import refusal
from .autocast import autocast_lever
from .deterministic import BENCHMARK_CONTRADICTS
from .spec import LeverSpec

__all__ = [
    "LEVER_NAMES",
    "MODEL_LEVER_NAMES",
    "PROCESS_LEVERS",
    "REGISTRY",
    "LeverSpec",
    "autocast_lever",
    "check_levers",
    "check_model",
    "lever_spec",
    "register_lever",
    "specs",
    "unregister_lever",
]

# The device types whose thread-local state a snapshot describes.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
# The modules of speedflags.levers that are its machinery, not levers.
_MACHINERY = frozenset({"arguments", "culprits", "guarded", "lever_sets", "registry", "spec"})
# Keywords of fast_math and @speedup that are not levers: no lever may take their names.
_OPTIONS = frozenset(
    {"device", "strict", "label", "check_ranks", "model", "compile", "inference", "func"}
)


def _declared() -> tuple[LeverSpec, ...]:
    """Every built-in lever's declaration, in application order."""
    found: list[LeverSpec] = []
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name.startswith("_") or info.name in _MACHINERY:
            continue
        found.extend(getattr(importlib.import_module(f"{package}.{info.name}"), "DECLARED", ()))
    return tuple(sorted(found, key=lambda spec: spec.order))


REGISTRY: tuple[LeverSpec, ...] = ()
LEVER_NAMES: tuple[str, ...] = ()
MODEL_LEVER_NAMES: tuple[str, ...] = ()
PROCESS_LEVERS: Mapping[str, DeviceLever] = {}
_BY_NAME: dict[str, LeverSpec] = {}
_lock = threading.Lock()
# incremented whenever the registry changes: whoever keeps something derived from it (the
# leak plugin's domains) knows when to derive it again
version = 0


def _publish(registry: tuple[LeverSpec, ...]) -> None:
    global REGISTRY, LEVER_NAMES, MODEL_LEVER_NAMES, PROCESS_LEVERS, _BY_NAME, version
    REGISTRY = registry
    LEVER_NAMES = tuple(spec.name for spec in registry)
    MODEL_LEVER_NAMES = tuple(spec.name for spec in registry if spec.per_model)
    PROCESS_LEVERS = {spec.name: spec.lever() for spec in registry if spec.scope == "process"}
    _BY_NAME = {spec.name: spec for spec in registry}
    version += 1


_publish(_declared())


def specs() -> tuple[LeverSpec, ...]:
    """The levers, in application order (the built-in ones, then those registered)."""
    return REGISTRY


def lever_spec(name: object, call: str = "speedflags") -> LeverSpec:
    """The registry entry for the ``fast_math`` keyword ``name``.

    Raises:
        InvalidValueError: ``name`` is not a lever; the message lists the valid ones.

    Example:
        >>> from speedflags.levers.registry import lever_spec
        >>> lever_spec("tf32").scope
        'process'
    """
    spec = _BY_NAME.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidValueError(f"{call}: unknown lever {short_repr(name)}; valid: {valid_names()}")
    return spec


def valid_names() -> str:
    """The lever keywords, sorted and comma-separated (for error messages)."""
    return ", ".join(sorted(LEVER_NAMES))


def check_levers(call: str, given: Mapping[str, object]) -> tuple[tuple[str, Any], ...]:
    """Validate ``fast_math``-style lever arguments; return ``(name, value)`` in order.

    ``None`` means "leave unchanged" and is dropped (so is ``UNSET``, its old public
    spelling). An unknown name raises ``InvalidTypeError`` (like any unexpected keyword
    argument) listing the valid ones; a bad value raises what :meth:`LeverSpec.check`
    raises; ``tf32`` and ``matmul_precision`` asking for opposite cuBLAS TF32 settings raise
    ``InvalidValueError``, and so do ``deterministic=True`` and ``cudnn_benchmark=True``
    (nested, one block inside the other's, the inner one's enter is refused the same way: the
    levers' own check, ``deterministic.refuse_nested``).

    Example:
        >>> from speedflags.levers.registry import check_levers
        >>> check_levers("fast_math", {"amp": "bf16", "tf32": True, "sdpa": None})
        (('tf32', True), ('amp', torch.bfloat16))
    """
    unknown = [name for name in given if name not in _BY_NAME]
    if unknown:
        raise InvalidTypeError(
            f"{call}() got an unexpected keyword argument {short_repr(unknown[0])}; the levers are "
            f"{valid_names()}, and the other arguments are keyword-only"
        )
    checked = tuple(
        (spec.name, spec.check(call, given[spec.name]))
        for spec in REGISTRY
        if given.get(spec.name, UNSET) is not UNSET and given[spec.name] is not None
    )
    _refuse_contradictions(call, dict(checked))
    return checked


def check_model(call: str, model: object, levers: Sequence[tuple[str, Any]]) -> None:
    """Refuse a ``model=`` that the checked ``levers`` cannot take: a model lever without a
    model, a model that is not an ``nn.Module``, whose parameters another system owns
    (FSDP) or that is TorchScript, or a model given with no model lever.

    Example:
        >>> import torch
        >>> from speedflags.levers.registry import check_model
        >>> check_model("fast_math", torch.nn.Linear(2, 2), (("param_dtype", torch.bfloat16),))
    """
    wanted = [name for name, _ in levers if _BY_NAME[name].per_model]
    if model is None:
        if wanted:
            raise InvalidValueError(
                f"{call}({wanted[0]}=...): {wanted[0]} acts on one model: give it as model=, "
                f"e.g. {call}(model=net, {wanted[0]}=...)"
            )
        return
    if not isinstance(model, torch.nn.Module):
        raise InvalidTypeError(
            f"{call}(model={short_repr(model)}): expected a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    if not wanted:
        raise InvalidValueError(
            f"{call}(model={type(model).__name__}): model= is for the model levers "
            f"({', '.join(MODEL_LEVER_NAMES)}), and none was given"
        )
    refused = refusal(model)
    if refused is not None:
        raise InvalidValueError(f"{call}(model={type(model).__name__}, {wanted[0]}=...): {refused}")


def shown_levers(given: Mapping[str, object]) -> list[str]:
    """``name=value`` for each lever argument given (``None`` too), in registry order: how a
    call's label shows them.

    Example:
        >>> from speedflags.levers.registry import shown_levers
        >>> shown_levers({"amp": "bf16", "tf32": True})
        ['tf32=True', "amp='bf16'"]
    """
    return [
        f"{spec.name}={given[spec.name]!r}"
        for spec in REGISTRY
        if given.get(spec.name, UNSET) is not UNSET
    ]


def _refuse_contradictions(call: str, values: Mapping[str, Any]) -> None:
    if values.get("deterministic") is True and values.get("cudnn_benchmark") is True:
        raise InvalidValueError(
            f"{call}(deterministic=True, cudnn_benchmark=True): contradictory: "
            f"{BENCHMARK_CONTRADICTS}; use cudnn_benchmark=False, or leave "
            "one of them out"
        )
    tf32 = values.get("tf32")
    precision = values.get("matmul_precision")
    if tf32 is None or precision is None or tf32 == (precision != "highest"):
        return
    fix = "tf32=True" if precision != "highest" else "matmul_precision='high' or 'medium'"
    raise InvalidValueError(
        f"{call}(tf32={tf32!r}, matmul_precision={precision!r}): contradictory: matmul "
        f"precision {precision!r} turns cuBLAS TF32 {'on' if precision != 'highest' else 'off'}; "
        f"use {fix}, or leave one of them out"
    )


# --- levers of one's own --------------------------------------------------------------------

_REQUIRED = ("name", "scope", "domain", "checks_state", "read", "check", "apply", "restore",
             "describe", "describe_value", "validate")  # fmt: skip


def register_lever(lever: Any) -> LeverSpec:
    """Make ``lever`` a keyword of ``fast_math``, ``@speedup`` and ``Schedule`` entries, like
    the built-in levers: validated before anything changes, nested, restored exactly,
    recorded in the history, shown by ``snapshot()``, ``report`` and the leak plugin.

    ``lever`` follows the :class:`~speedflags.levers._base.Lever` protocol (``docs/ledger.md``:
    ``name``, ``scope``, ``domain``, ``checks_state``, ``read``, ``check``, ``apply``,
    ``restore``, ``describe``, ``describe_value``) and has ``validate(value)``, which returns
    the value to apply or raises ``ValueError``/``TypeError`` saying what is wrong. Optional
    attributes, read when present: ``available(value, device)`` (an
    :class:`~speedflags.levers.Effect`; default: in effect everywhere), ``summary``,
    ``accuracy`` and ``values`` (words for help and the report), ``baseline`` (its "off"
    value), ``candidates`` (values ``tune`` tries) and ``dynamo_misses`` (what of its state
    ``torch.compile`` does not guard: ``@speedup(compile=...)`` and ``guard_levers`` then
    compile again when it changes).

    Scope: process; the registry is the process's. A lever's scope is ``"process"`` (one
    state for the process) or ``"thread"`` (one per thread).

    Returns:
        Its :class:`~speedflags.levers.spec.LeverSpec`.

    Raises:
        InvalidTypeError: ``lever`` lacks part of the protocol (named).
        InvalidValueError: its name is taken (a built-in lever, a registered one, or an
            argument of ``fast_math``) or is not an identifier, its scope is neither
            ``"process"`` nor ``"thread"``, or its domain is another lever's.

    Example:
        >>> import speedflags
        >>> class Knob:  # a process-wide setting of one's own, over a dict
        ...     name = domain = "knob"
        ...     scope = "process"
        ...     checks_state = False
        ...     state = {"knob": 0}
        ...     def validate(self, value):
        ...         if not isinstance(value, int): raise TypeError("expected an int")
        ...         return value
        ...     def read(self): return self.state["knob"]
        ...     def check(self, state): pass
        ...     def apply(self, value, before): self.state["knob"] = value; return value
        ...     def restore(self, target, current): return self.apply(target, current)
        ...     def describe(self, state): return state
        ...     def describe_value(self, value): return value
        >>> _ = speedflags.register_lever(Knob())
        >>> with speedflags.fast_math(knob=3):
        ...     Knob.state["knob"]
        3
        >>> Knob.state["knob"], speedflags.snapshot()["knob"]
        (0, 0)
        >>> speedflags.unregister_lever("knob")
    """
    missing = _missing(lever)
    if missing:
        raise InvalidTypeError(
            f"register_lever({short_repr(lever)}): not a lever: it has no "
            f"{', '.join(missing)} (the Lever protocol of docs/ledger.md, and validate)"
        )
    name, scope, domain = lever.name, lever.scope, lever.domain
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidValueError(
            f"register_lever(...): its name {short_repr(name)} is not a keyword argument name"
        )
    if scope not in ("process", "thread"):
        raise InvalidValueError(
            f"register_lever({name}): scope {short_repr(scope)}; valid: 'process', 'thread'"
        )
    if not isinstance(domain, str) or not domain:
        raise InvalidValueError(
            f"register_lever({name}): domain {short_repr(domain)}: expected a name"
        )
    # (no loop in the locked sections below, comprehensions included: Python 3.12 inlines
    # them, and a loop inside a with-block can leave its handler uncovered; the helpers loop)
    with _lock:
        if name in _BY_NAME or name in _OPTIONS:
            taken = (
                "a built-in lever"
                if name in _BY_NAME and _BY_NAME[name].builtin
                else ("a registered lever" if name in _BY_NAME else "an argument of fast_math")
            )
            raise InvalidValueError(
                f"register_lever({name}): the name {name!r} is taken ({taken}); lever names "
                "are unique: unregister_lever() the other first, or choose another name"
            )
        owner = _domain_owner(domain)
        if owner is not None:
            raise InvalidValueError(
                f"register_lever({name}): domain {domain!r} is {owner}'s: a lever's domain "
                "names the state it writes, and the ledger keeps one stack of frames per domain"
            )
        spec = _spec_of(lever)
        _publish((*REGISTRY, spec))
    return spec


def _missing(lever: Any) -> list[str]:
    """What ``lever`` lacks of the Lever protocol (a loop of its own: Python 3.12 inlines a
    comprehension into its function, where the exception-table test counts its loop)."""
    return [attribute for attribute in _REQUIRED if not hasattr(lever, attribute)]


def _domain_owner(domain: str) -> str | None:
    """The name of the lever (not a model lever) whose domain is ``domain``, or None."""
    for spec in REGISTRY:
        if spec.scope != "model" and spec.lever().domain == domain:
            return spec.name
    return None


def _registered() -> tuple[LeverSpec, ...]:
    """The levers :func:`register_lever` added, in their order."""
    return tuple(s for s in REGISTRY if not s.builtin)


def unregister_lever(name: str) -> None:
    """Take back a lever :func:`register_lever` added: its keyword is refused from then on
    (specs built with it keep working, and their blocks still restore it).

    Scope: process.

    Raises:
        InvalidValueError: ``name`` is a built-in lever, or no registered one (the message
            lists the registered levers).

    Example:
        >>> import speedflags
        >>> try:
        ...     speedflags.unregister_lever("tf32")
        ... except ValueError as exc:
        ...     print(exc)
        unregister_lever('tf32'): a built-in lever stays registered
    """
    with _lock:
        spec = _BY_NAME.get(name)
        if spec is not None and spec.builtin:
            raise InvalidValueError(
                f"unregister_lever({short_repr(name)}): a built-in lever stays registered"
            )
        if spec is None:
            registered = ", ".join(s.name for s in _registered()) or "none"
            raise InvalidValueError(
                f"unregister_lever({short_repr(name)}): no such registered lever; registered: "
                f"{registered}"
            )
        _publish(_without(spec))


def _without(spec: LeverSpec) -> tuple[LeverSpec, ...]:
    return tuple(s for s in REGISTRY if s is not spec)


def _spec_of(lever: Any) -> LeverSpec:
    """The declaration of a registered lever, from its attributes."""
    available = getattr(lever, "available", None)

    def validate(value: object) -> Any:
        try:
            return lever.validate(value)
        except (InvalidValueError, InvalidTypeError):
            raise
        except TypeError as exc:  # the lever's words, as speedflags' own error types
            raise InvalidTypeError(str(exc)) from None
        except ValueError as exc:
            raise InvalidValueError(str(exc)) from None

    def effect(value: Any, device: torch.device) -> Effect:
        return Effect(True, "") if available is None else available(value, device)

    return LeverSpec(
        name=lever.name,
        scope=lever.scope,
        values=str(getattr(lever, "values", "") or "what its validate() accepts"),
        validate=validate,
        make=lambda _key: lever,
        summary=str(getattr(lever, "summary", "") or f"{lever.name} (registered)"),
        accuracy=str(getattr(lever, "accuracy", "") or "not stated"),
        order=1000 + len(REGISTRY),
        baseline=getattr(lever, "baseline", UNSET),
        candidates=tuple(getattr(lever, "candidates", ())),
        dynamo_misses=str(getattr(lever, "dynamo_misses", "")),
        effect_of=effect,
        describe=lever.describe_value,
        builtin=False,
    )
