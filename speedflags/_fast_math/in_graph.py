"""What a spec does while dynamo traces it: inside a function given to ``torch.compile``.

A spec's *form* in a graph, decided at trace time from its plan (``docs/inside_compile.md``):

- ``amp`` alone (or nothing that applies here): the block is a native ``torch.autocast``
  region of the graph, which dynamo traces on every supported PyTorch (with
  ``fullgraph=True`` too): the graph computes what eager computes. The ledger records the
  block once per trace, action ``"traced"`` (no ``set``/``restore`` pair: nothing is written
  outside the graph).
- any process-wide lever (or a rank check still to make): a graph cannot set it (dynamo drops
  the write, or bakes it in for the first call only, and does not guard it), so the block
  runs eagerly, a graph break around it, through the ledger as outside compiled code: the
  levers really in force, restored after. Under ``fullgraph=True``, where a graph break is an
  error, :class:`~speedflags.LeverInGraphError` says what to do instead.

Specs built in traced code (``fast_math(...)``, the shorthands) are built at trace time too:
their arguments are validated there, with the usual errors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._ledger.decorate import FRAMED, InGraph, own_code
from .._ledger.history import format_where
from .._ledger.ledger import ledger
from .._ledger.scope import ENTER, EXIT
from .._tracing import (
    KeptOut,
    at_trace_time,
    first_trace,
    graph_error,
    hooked,
    is_compiling,
    one_graph,
    traced_where,
)
from ..errors import LeverInGraphError, SpeedflagsError
from ..levers.autocast import AutocastLever

__all__ = [
    "BUILDERS",
    "built_in_graph",
    "decorated_in_graph",
    "enter_in_graph",
    "exit_in_graph",
    "spec_in_graph",
    "step_in_graph",
]

B = TypeVar("B", bound=Callable[..., Any])
_LEDGER = ledger()
AUTOCAST, NOTHING, EAGER = "autocast", "nothing", "eager"
# (AUTOCAST, device type, dtype name or None for amp=False) | (NOTHING,) | (EAGER,)
Form = tuple[Any, ...]

# The functions that build a spec from a public call's arguments, by name: fast_math's
# FastMath and each shorthand's builder register here, and run at trace time.
BUILDERS: dict[str, Callable[..., Any]] = {}

WHAT_TO_DO = (
    "Set it outside the compiled function (`with {label}: compiled(...)`), or use "
    "@speedup(compile=..., {levers}) around the step; without fullgraph=True the block runs "
    "eagerly, a graph break around it, with the levers in force."
)


def _form(spec: Any, label: str, carried: bool = True, where: Any = None) -> Form:
    """At trace time: the form of ``spec`` here (recorded), or LeverInGraphError. ``where``:
    the place to name when dynamo traced no user line (a decorated function compiled itself:
    its ``def``)."""
    plan = spec._plan()  # LeverUnavailableError with strict=True, as on entry
    program = plan.program
    rank_check = spec._rank_check
    kept = [
        f"{lever.name}={lever.describe_value(value)!r}"
        for lever, value in zip(program.levers, program.values, strict=True)
        if not (carried and isinstance(lever, AutocastLever))
    ]
    if rank_check is not None and not rank_check.done:
        kept.append("check_ranks=True")
    where = traced_where() or where
    if kept:
        if one_graph():
            levers = ", ".join(kept)
            raise LeverInGraphError(
                f"{label} sets {levers} inside a function compiled with fullgraph=True "
                f"({format_where(where) or 'traced code'}): a graph cannot set a process-wide "
                "lever (dynamo drops the write or keeps it for the first call only, and does "
                "not guard it). " + WHAT_TO_DO.format(label=label, levers=levers)
            )
        return (EAGER,)
    form: Form = (NOTHING,)
    if program.n:
        lever, value = program.levers[0], program.values[0]
        dtype = None if value is None else str(value).replace("torch.", "")
        form = (AUTOCAST, lever.device_type, dtype)
    if first_trace(label, where):
        _record(program, form, label, where)
    return form


def _record(program: Any, form: Form, label: str, where: Any) -> None:
    if form[0] != AUTOCAST:
        shown = "nothing"
    elif form[2] is None:
        shown = f"torch.autocast({form[1]!r}, enabled=False)"
    else:
        shown = f"torch.autocast({form[1]!r}, dtype=torch.{form[2]})"
    for lever, value, reason in zip(program.levers, program.values, program.reasons, strict=True):
        why = (
            f"traced into a torch.compile graph as {shown}: in effect wherever the graph runs; "
            "recorded when traced, not at each call"
        )
        _LEDGER.note(
            lever.name, "traced", "; ".join(r for r in (why, reason) if r),
            after=lever.describe_value(value), label=label, where=where,
        )  # fmt: skip
    for name, reason in program.skipped:
        _LEDGER.note(name, "skip", reason, label=label, where=where)


def _autocast(form: Form) -> Any:
    # A plain function returning torch.autocast: dynamo traces `with _autocast(form):` natively
    # (a no-op context for NOTHING). Functions that may run eagerly inside compiled code never
    # name the torch module: 2.13's dynamo compiles such a function as a frame of its own.
    if form[0] == NOTHING:
        return torch.set_grad_enabled(torch.is_grad_enabled())
    if form[2] is None:
        return torch.autocast(form[1], enabled=False)  # type: ignore[attr-defined, unused-ignore]
    return torch.autocast(form[1], dtype=getattr(torch, form[2]))  # type: ignore[attr-defined, unused-ignore]


# --- a spec built in traced code: fast_math(...), autocast(...), ... ----------------------


@at_trace_time
def _built_form(builder: str, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> Form:
    KeptOut.prepare()
    if traced_where() is None:
        # no user line traced: dynamo compiles this builder as a frame of its own, called by
        # code that runs eagerly, where the spec is what that code needs
        return (EAGER,)
    try:
        spec = BUILDERS[builder](*args, **dict(kwargs))
        return _form(spec, spec._label)
    except SpeedflagsError as exc:  # a bad argument, strict=True, or LeverInGraphError
        raise graph_error(exc) from None


def _build_eagerly(builder: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return BUILDERS[builder](*args, **kwargs)


_BUILD = KeptOut(_build_eagerly)


def _eager_form(spec: str, fix: str) -> Form:
    """The form of a spec that runs eagerly in traced code (at trace time: never traced),
    refused under fullgraph=True, where nothing may run eagerly."""
    KeptOut.prepare()
    if one_graph():
        where = format_where(traced_where()) or "traced code"
        raise graph_error(
            LeverInGraphError(
                f"a speedflags spec {spec} with fullgraph=True ({where}): it runs eagerly, "
                f"which a full graph cannot. {fix}"
            )
        )
    return (EAGER,)


@at_trace_time
def _model_form() -> Form:
    # A spec given a model: a model is no constant dynamo can hand to a trace-time function
    # (PyTorch 2.1 cannot pass user objects), and model levers are never a graph's: eager.
    return _eager_form(
        "with model levers is built inside a function compiled",
        "Enter it outside the compiled function: a model compiled before the block follows it.",
    )


def spec_in_graph(builder: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``BUILDERS[builder](*args, **kwargs)`` called in traced code: a ``torch.autocast``
    (amp only), a no-op context (nothing applies here), or the spec itself, built eagerly (a
    graph break; ``with`` it runs its block eagerly). Called eagerly inside compiled code
    (:data:`~speedflags._tracing.hooked`): the spec, built out of dynamo's way."""
    # (a membership test, not kwargs.get: PyTorch 2.1's dynamo cannot trace dict.get here)
    if is_compiling() and "model" in kwargs and kwargs["model"] is not None:
        _model_form()
    elif is_compiling():
        form = _built_form(builder, args, tuple(kwargs.items()))
        if form[0] != EAGER:
            return _autocast(form)
    else:
        KeptOut.prepare()
    return _BUILD.call(builder, args, kwargs)


def built_in_graph(builder: B) -> B:
    """``builder`` (a public function that returns a spec: a shorthand), callable in traced
    code too, where it returns what :func:`spec_in_graph` gives."""
    name = builder.__name__
    BUILDERS[name] = builder

    @functools.wraps(builder)
    def public(*args: Any, **kwargs: Any) -> Any:
        if is_compiling() or hooked():  # inside torch.compile: traced, or eager in it
            return spec_in_graph(name, args, kwargs)
        return builder(*args, **kwargs)

    return own_code(public)  # type: ignore[return-value]


# --- a decorated function called in traced code -------------------------------------------


def decorated_in_graph(spec: Any, label: str, func: Any, carried: bool = True) -> InGraph:
    """What a function decorated with ``spec`` does inside compiled code. Traced: its body in
    an autocast region (amp only), or eagerly in a frame, a graph break (``carried=False``:
    always so, as ``@speedup`` steps run). Called eagerly there: eagerly in a frame, out of
    dynamo's way."""

    code = getattr(func, "__code__", None)
    defined = None if code is None else (code.co_filename, code.co_firstlineno)

    @at_trace_time
    def form() -> Form:
        KeptOut.prepare()
        try:
            return _form(spec, label, carried, defined)
        except SpeedflagsError as exc:
            raise graph_error(exc) from None

    def call_in_graph(
        func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if is_compiling():
            how = form()
            if how[0] == AUTOCAST:
                with _autocast(how):
                    return func(*args, **kwargs)
            if how[0] == NOTHING:
                return func(*args, **kwargs)
        else:
            KeptOut.prepare()
        return FRAMED.call(func, args, kwargs, spec, label)

    return call_in_graph


def step_in_graph(
    spec: Any, label: str, target: Callable[..., Any], stats: Any, func: Any
) -> InGraph:
    """What a ``@speedup`` step (``target``, counted in ``stats``) does when called inside
    compiled code: the whole step runs eagerly in its frame, its own compile included (a
    graph break; under ``fullgraph=True``, :class:`~speedflags.LeverInGraphError`)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        stats.calls += 1
        return target(*args, **kwargs)

    call = decorated_in_graph(spec, label, func, carried=False)
    return lambda _target, args, kwargs: call(counted, args, kwargs)


# --- `with spec:` for a spec built outside traced code -----------------------------------
# Dynamo does not trace a `with` on a spec it did not see built (2.13: "Unsupported context
# manager"; 2.1: SETUP_WITH): it runs that code eagerly, where __enter__ and __exit__ come
# here, eagerly (dynamo's hook set) or compiled as frames of their own.


@at_trace_time
def _entered_form() -> Form:
    return _eager_form(
        "built outside the compiled function (or as FastMath(...)) is entered inside it",
        "Build an amp-only block inline (`with speedflags.autocast(...)`, traced into the "
        "graph), or set the levers outside the compiled function.",
    )


def _kept_out_ready() -> None:
    if is_compiling():
        _entered_form()
    else:
        KeptOut.prepare()


def enter_in_graph(spec: Any) -> Any:
    """``spec.__enter__`` inside compiled code: the frame opened out of dynamo's way (or,
    under ``fullgraph=True``, LeverInGraphError)."""
    _kept_out_ready()
    return ENTER.call(spec)


def exit_in_graph(spec: Any) -> None:
    """``spec.__exit__`` inside compiled code: the frame closed out of dynamo's way."""
    _kept_out_ready()
    EXIT.call(spec)
