"""The lever registry: the one list of levers that everything else reads.

Three kinds of lever join it, each once: the built-in levers, declared in their own modules
(``DECLARED``, made with :func:`~speedflags.levers.spec.declare`) and listed by module in
:data:`BUILT_IN_MODULES`; a program's or library's own, given to
:func:`register_lever` (or made with ``speedflags.lever``, which registers it); and the
levers installed packages declare under the entry-point group ``speedflags.levers``
(:mod:`.installed`), registered the first time something asks for every lever
(:func:`specs`, :func:`lever_names`) or for a name the registry does not know yet
(:func:`lever_spec`, :func:`check_levers`). ``fast_math``, ``@speedup``, ``Schedule``, the
report, the bench configurations, the rank check, ``watch``, the pytest plugin, the
integrations and ``tune`` derive their lever lists from it.

The registry changes as levers are registered and taken back: :data:`REGISTRY` and the
names below are rebound each time (read them as ``registry.REGISTRY`` when used, not once
at import), and :data:`version` counts the changes for whoever derives something from them.
:data:`REGISTRY` holds the levers registered so far; :func:`specs` also registers the
installed ones first.

Example:
    >>> from speedflags.levers.registry import LEVER_NAMES, lever_spec
    >>> LEVER_NAMES  # doctest: +NORMALIZE_WHITESPACE
    ('tf32', 'matmul_precision', 'cudnn_benchmark', 'sdpa', 'deterministic',
     'reduced_precision_reduction', 'amp', 'param_dtype', 'memory_format', 'fp8')
    >>> spec = lever_spec("amp")
    >>> spec.shorthand.name, spec.scope, spec.check("fast_math", "bf16")
    ('autocast', 'thread', torch.bfloat16)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _warn
from .._locks import new_lock
from .._short_repr import short_repr
from ..errors import InstalledLeverWarning, InvalidTypeError, InvalidValueError
from ._base import UNSET, DeviceLever, Effect
from ._model_state import refusal
from .autocast import autocast_lever
from .deterministic import BENCHMARK_CONTRADICTS
from .spec import LeverSpec

__all__ = [
    "BUILT_IN_MODULES",
    "LEVER_NAMES",
    "MODEL_LEVER_NAMES",
    "PROCESS_LEVERS",
    "REGISTRY",
    "LeverSpec",
    "autocast_lever",
    "check_levers",
    "check_model",
    "lever_names",
    "lever_spec",
    "load_installed",
    "register",
    "register_lever",
    "specs",
    "unregister_lever",
]

# The modules of speedflags.levers that declare the built-in levers (``DECLARED``): adding a
# built-in lever is its module's line here. A frame applies them in their ``order``.
BUILT_IN_MODULES = (
    "precision",
    "cudnn",
    "sdpa",
    "deterministic",
    "reductions",
    "autocast",
    "param_dtype",
    "memory_format",
    "fp8",
)
# The device types whose thread-local state a snapshot describes.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
# Keywords of fast_math and @speedup that are not levers: no lever may take their names.
_OPTIONS = frozenset(
    {
        "device",
        "strict",
        "label",
        "check_ranks",
        "model",
        "compile",
        "cuda_graphs",
        "inference",
        "func",
    }
)


def _built_in() -> tuple[LeverSpec, ...]:
    """Every built-in lever's declaration, in application order."""
    found: list[LeverSpec] = []
    for name in BUILT_IN_MODULES:
        found.extend(importlib.import_module(f"{__package__}.{name}").DECLARED)
    return tuple(sorted(found, key=lambda spec: spec.order))


REGISTRY: tuple[LeverSpec, ...] = ()
LEVER_NAMES: tuple[str, ...] = ()
MODEL_LEVER_NAMES: tuple[str, ...] = ()
PROCESS_LEVERS: Mapping[str, DeviceLever] = {}
_BY_NAME: dict[str, LeverSpec] = {}
# name -> the object its author registered (a lever written to part of the protocol is kept
# in the registry completed with the defaults: this is how the same object is known again)
_OWN: dict[str, object] = {}
_lock = new_lock()
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


_publish(_built_in())


def specs() -> tuple[LeverSpec, ...]:
    """Every lever, in application order (the built-in ones, then the others in the order
    they were registered), the installed packages' levers registered first."""
    load_installed()
    return REGISTRY


def lever_names() -> tuple[str, ...]:
    """Every lever's ``fast_math`` keyword, in application order (as :func:`specs`)."""
    load_installed()
    return LEVER_NAMES


def lever_spec(name: object, call: str = "speedflags") -> LeverSpec:
    """The registry entry for the ``fast_math`` keyword ``name`` (an installed package's
    lever of that name is registered first).

    Raises:
        InvalidValueError: ``name`` is not a lever; the message lists the valid ones.

    Example:
        >>> from speedflags.levers.registry import lever_spec
        >>> lever_spec("tf32").scope
        'process'
    """
    spec = _BY_NAME.get(name) if isinstance(name, str) else None
    if spec is None and isinstance(name, str) and load_installed(name):
        spec = _BY_NAME.get(name)
    if spec is None:
        raise InvalidValueError(
            f"{call}: unknown lever {short_repr(name)}; valid: {valid_names()}{_why_not(name)}"
        )
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
    unknown = [name for name in given if name not in _BY_NAME and not load_installed(name)]
    if unknown:
        raise InvalidTypeError(
            f"{call}() got an unexpected keyword argument {short_repr(unknown[0])}; the levers are "
            f"{valid_names()}, and the other arguments are keyword-only{_why_not(unknown[0])}"
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


# --- levers of one's own ----------------------------------------------------------------------


def register_lever(lever: Any) -> LeverSpec:
    """Make ``lever`` a keyword of ``fast_math``, ``@speedup`` and ``Schedule`` entries, like
    the built-in levers: validated before anything changes, nested, restored exactly,
    recorded in the history, shown by ``snapshot()``, ``report`` and the leak plugin.

    ``speedflags.lever(name, read=..., write=...)`` makes and registers a lever from two
    functions; this takes an object written to the lever protocol (``docs/your_own_levers.md``),
    of which ``name``, ``read()`` and ``apply(value, before)`` are required: ``apply`` writes
    and returns the state ``read()`` answers afterwards (the one rule for every write). The
    rest have defaults: ``domain`` (its name), ``scope`` (``"process"``; or ``"thread"``),
    ``restore(target, current)`` (``apply``), ``check(state)`` (nothing refused),
    ``validate(value)`` (returns the value to apply, or raises ``ValueError``/``TypeError``
    saying what is wrong; default: every value), ``describe(state)`` and
    ``describe_value(value)`` (the state as it is). Optional attributes, read when present:
    ``available(value, device)`` (an :class:`~speedflags.levers.Effect`; default: in effect
    everywhere), ``summary``, ``accuracy`` and ``values`` (words for help and the report),
    ``baseline`` (its "off" value), ``candidates`` (values ``tune`` tries) and
    ``dynamo_misses`` (what of its state ``torch.compile`` does not guard:
    ``@speedup(compile=...)`` and ``guard_levers`` then compile again when it changes).
    ``read()`` is called once, here.

    Registering the same object again does nothing (a module that makes its lever at import
    and is also loaded through its entry point registers it once).

    Scope: process; the registry is the process's. A lever's own scope is ``"process"`` (one
    state for the process) or ``"thread"`` (one per thread).

    Returns:
        Its :class:`~speedflags.levers.spec.LeverSpec`.

    Raises:
        InvalidTypeError: ``lever`` lacks a required member (named), a method of it is not
            callable, or its ``read()`` answers a value that is not hashable.
        InvalidValueError: its name is taken (a built-in lever, another registered one, or
            an argument of ``fast_math``) or is not an identifier, its scope is neither
            ``"process"`` nor ``"thread"``, its domain is another lever's (a built-in lever's
            domains include every device's autocast, ``amp:<device>``, and every model's
            model levers, ``param_dtype:<model>``), or its ``read()`` raises.

    Example:
        >>> import speedflags
        >>> class Knob:  # a process-wide setting of one's own, over a dict
        ...     name = "knob"
        ...     state = {"knob": 0}
        ...     def read(self): return self.state["knob"]
        ...     def apply(self, value, before):
        ...         self.state["knob"] = value
        ...         return self.read()  # the state read back: the rule for every write
        >>> _ = speedflags.register_lever(Knob())
        >>> with speedflags.fast_math(knob=3):
        ...     Knob.state["knob"]
        3
        >>> Knob.state["knob"], speedflags.snapshot()["knob"]
        (0, 0)
        >>> speedflags.unregister_lever("knob")
    """
    name = getattr(lever, "name", None)
    return register(lever, f"register_lever({short_repr(name) if name is not None else '...'})")


def register(lever: Any, call: str) -> LeverSpec:
    """:func:`register_lever`, its errors naming ``call`` (``speedflags.lever`` uses it)."""
    from .own import checked, completed  # local: loaded by the first lever of one's own

    try:
        whole = completed(lever)
    except InvalidTypeError as exc:
        raise InvalidTypeError(f"{call}: {exc}") from None
    if _OWN.get(whole.name) is lever:
        return _BY_NAME[whole.name]  # the same object again: registered once
    checked(call, whole)  # calls its read(): outside the lock
    name = whole.name
    # (no loop in the locked sections below, comprehensions included: Python 3.12 inlines
    # them, and a loop inside a with-block can leave its handler uncovered; the helpers loop)
    with _lock:
        if _OWN.get(name) is lever:
            return _BY_NAME[name]
        if name in _BY_NAME or name in _OPTIONS:
            raise InvalidValueError(
                f"{call}: the name {name!r} is taken ({_taken_by(name)}); lever names are "
                "unique: unregister_lever() the other first, or choose another name"
            )
        owner = _domain_owner(whole.domain)
        if owner is not None:
            raise InvalidValueError(
                f"{call}: domain {whole.domain!r} is {owner}'s: a lever's domain names the state "
                "it writes, and the ledger keeps one stack of frames per domain"
            )
        spec = _spec_of(whole)
        _OWN[name] = lever
        _publish((*REGISTRY, spec))
    return spec


def _taken_by(name: str) -> str:
    if name not in _BY_NAME:
        return "an argument of fast_math"
    return "a built-in lever" if _BY_NAME[name].builtin else "a registered lever"


def _domain_owner(domain: str) -> str | None:
    """The name of the lever whose domains include ``domain``, or None."""
    for spec in REGISTRY:
        if spec.owns_domain(domain):
            return spec.name
    return None


def _registered() -> tuple[LeverSpec, ...]:
    """The levers :func:`register_lever` added, in their order."""
    return tuple(s for s in REGISTRY if not s.builtin)


def unregister_lever(name: str) -> None:
    """Take back a lever :func:`register_lever` (or ``speedflags.lever``) added: its keyword
    is refused from then on (specs built with it keep working, and their blocks still
    restore it).

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
        _OWN.pop(name, None)
        _publish(_without(spec))


def _without(spec: LeverSpec) -> tuple[LeverSpec, ...]:
    return tuple(s for s in REGISTRY if s is not spec)


def _spec_of(lever: Any) -> LeverSpec:
    """The declaration of a registered lever (completed: the whole protocol), from its
    attributes."""
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

    values = getattr(lever, "values", "")
    if isinstance(values, tuple):  # a FunctionLever's accepted values
        values = "one of " + ", ".join(repr(v) for v in values)
    return LeverSpec(
        name=lever.name,
        scope=lever.scope,
        domain=lever.domain,
        values=str(values or "what its validate() accepts"),
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


# --- levers installed packages declare ---------------------------------------------------------

# the entry points tried so far, by name (each once per process, loaded or not), and why
# those that failed did
_TRIED: set[str] = set()
_FAILED: dict[str, str] = {}
_ALL_TRIED = False
_loading = new_lock()


def load_installed(name: str | None = None) -> bool:
    """Register the levers installed packages declare under the entry-point group
    ``speedflags.levers`` (:mod:`.installed`): every one, or the one called ``name``; each
    is tried once per process. True if ``name`` (when given) is a lever now.

    An entry that cannot be loaded (its module fails to import, it names something that is
    not a lever made with ``speedflags.lever``, or a lever of another name, or its name is
    taken) is left out with an :class:`~speedflags.InstalledLeverWarning`, once; the others
    load. Nothing is loaded while ``speedflags`` itself is being imported (an installed
    lever's module imports it).
    """
    if _ALL_TRIED or (name is not None and (name in _BY_NAME or name in _TRIED)):
        return name is not None and name in _BY_NAME
    from . import installed  # local: loaded by the first look for installed levers

    if installed.importing_speedflags():
        return False
    with _loading:  # one thread loads; the others wait for what it registers
        for entry in installed.entry_points():
            _try_installed(entry, name)  # a call: no loop body ending in an `if` under a `with`
        if name is None:
            _set_all_tried()
        else:
            _TRIED.add(name)
    return name is not None and name in _BY_NAME


def _try_installed(entry: Any, name: str | None) -> None:
    """Register ``entry``'s lever unless it was tried before or is not the one ``name``
    asks for; warn once if it cannot be."""
    if entry.name in _TRIED or (name is not None and entry.name != name):
        return
    _TRIED.add(entry.name)
    problem = _register_installed(entry)
    if problem is not None:
        _FAILED[entry.name] = problem
        _warn.warn_once(("installed lever", entry.name), problem, InstalledLeverWarning)


def _set_all_tried() -> None:
    global _ALL_TRIED
    _ALL_TRIED = True


def _register_installed(entry: Any) -> str | None:
    """Load one entry point and register the lever it names; why not, if it could not be."""
    from . import installed
    from .own import FunctionLever

    where = f"the lever {entry.name!r} that {installed.source(entry)} installs ({entry.value})"
    try:
        lever = entry.load()  # imports its module, which may register the lever itself
    except Exception as exc:
        return f"{where} could not be loaded: {type(exc).__name__}: {exc}"
    if not isinstance(lever, FunctionLever):
        return (
            f"{where} is not a lever made with speedflags.lever(): it is {short_repr(lever)}; "
            "an entry of the group 'speedflags.levers' names such a lever"
        )
    if lever.name != entry.name:
        return f"{where} is named {lever.name!r}: an entry's name is its lever's name"
    try:
        register_lever(lever)  # registered once: nothing if its module did it
    except (InvalidValueError, InvalidTypeError) as exc:
        return f"{where} cannot be registered: {exc}"
    return None


def _why_not(name: object) -> str:
    """For an unknown lever: why an installed lever of that name is not there, if one is."""
    problem = _FAILED.get(name) if isinstance(name, str) else None
    return f" ({problem})" if problem else ""
