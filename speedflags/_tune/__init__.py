"""``speedflags.tune``: the fastest lever set that keeps the user's own step accurate.

:func:`tune` measures every lever the device offers on the user's own step (a forward, a
loss, a whole train step) against plain fp32, and chooses; :class:`TuneResult` holds the
choice and every candidate; :func:`load_levers` reads a saved choice back. The search is in
:mod:`speedflags._tune.search`, the state reset in :mod:`speedflags._tune.state`, the command
line in :mod:`speedflags._tune.cli`. What it shares with ``bench`` and ``verify`` is in
:mod:`speedflags._measure`: the timing and rounds, the lever files
(:mod:`speedflags._measure.lever_files`), each lever's effect here and the verdicts a result
carries.

May import: :mod:`speedflags._measure` and every layer below the tools (``speedup``,
``fast_math``, ``status``, the levers' registry); never ``bench`` or ``verify``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._hardware import DeviceLike, default_device, missing_cuda, normalize_device
from .._measure.lever_files import LeversArg, load_levers, named_levers
from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from ..levers import registry
from ..levers._model_state import refusal
from ..levers.registry import check_model, lever_spec
from .candidates import verdicts_of
from .compare import Effort
from .result import Row, TuneResult
from .search import COMPILE, Search
from .state import find_state

__all__ = ["Row", "TuneResult", "load_levers", "run", "tune"]


def tune(
    fn: Callable[..., Any],
    *args: Any,
    budget: float = 1e-2,
    seconds: float | None = None,
    levers: LeversArg = None,
    device: DeviceLike = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> TuneResult:
    """Find the fastest levers whose error on ``fn(*args, **kwargs)`` stays within ``budget``.

    ``fn`` is the user's own step: a forward, a loss, or a whole train step returning the
    loss; it returns a tensor or a tuple, list or dict of tensors. The reference is the
    same call in plain fp32 with every lever off (``fast_math(**baseline_levers())``).
    Each candidate (the registry's values for each lever that has an effect on the device,
    then combinations of the accepted ones, then ``torch.compile`` on top of the choice)
    is first checked for accuracy: its error is the largest relative error
    ``||y - y_ref|| / ||y_ref||`` over the outputs, and an output that is not finite
    rejects it. Those within the budget are timed with the bench's timing (warm-up, device
    synchronisation, repeated rounds) in successive halving: a short timing for all, a
    longer one in interleaved passes for the faster half. A lever stays in the choice only
    when it is faster beyond the noise (see :mod:`speedflags._tune.search`).

    A train step does not drift: every module, optimizer, learning-rate scheduler and grad
    scaler found in the arguments, in ``fn`` itself (its object, closure, partial
    arguments) or in the globals its code names is copied (``copy.deepcopy`` of its
    ``state_dict()``, with the parameters' ``.grad``) before the first call, and put back
    with the torch RNG state before every call, outside the timed region. Pass other state
    as arguments (see :mod:`speedflags._tune.state`).

    Args:
        fn: the step.
        *args: the positional arguments ``fn`` is called with.
        **kwargs: the keyword arguments ``fn`` is called with (every keyword argument not
            listed here goes to ``fn``).
        budget: the largest relative error accepted (a positive number).
        seconds: a bound on the whole run, in seconds (a timing under way finishes its
            pass, so the run may overrun by a few calls); ``None``: no bound. With a bound,
            ``torch.compile`` is tried only when 30 s are left for it (compiling cannot be
            interrupted).
        levers: which levers to try: ``None`` for all (and ``"compile"``), a list of names
            (``["amp", "matmul_precision"]``, ``"compile"`` included or not), or a dict of
            name to the values to try (``{"amp": ["bf16"], "sdpa": ["flash"]}``). One that
            names nothing to try (``[]``, ``{}``, ``{"amp": []}``) is refused: nothing
            would be measured, and "plain fp32 wins" would be a claim never tested. A
            lever named without values that ``tune`` never tries by itself
            (``deterministic``: never faster) is left out; give it values to time it.
        device: the device the levers target (default: the device of the first tensor
            found in the arguments or the modules, else CUDA if available, else CPU).
        model: the ``nn.Module`` the model levers (``param_dtype``, ``memory_format``, ``fp8``) act
            on: given, they are candidates like the others (tune's own keyword: a step
            that takes a ``model`` argument gets it positionally). When ``fn`` is itself a
            module (``tune(net, x)``), it is the model. For an accepted
            ``param_dtype`` the row also gives the gap of the step's output to fp32's after
            several steps in a row (a train step's loss after that many optimizer steps).

    Returns:
        A :class:`TuneResult`: ``.best`` (``fast_math`` keyword arguments, ``{}`` when
        nothing beats fp32 within the budget), ``.rows``, ``str()`` a table, ``.save()``,
        ``.plot()``.

    Raises:
        InvalidValueError, InvalidTypeError: a bad argument (before anything runs; the
            message names the argument, quotes at most ~200 characters of its value and
            lists the valid choices), or a reference that returns no tensor or a non-finite
            one.

    Scope: every call runs inside ``fast_math`` frames: the process-wide levers and the
    calling thread's autocast, each restored when the frame closes; after ``tune``
    returns (or raises), every flag reads as before, and the step's state is left as the
    last call left it.

    Example:
        >>> import torch, speedflags
        >>> model = torch.nn.Linear(64, 64)
        >>> result = speedflags.tune(model, torch.randn(32, 64), budget=1e-9, seconds=5)
        >>> result.best  # no lever keeps the error under 1e-9
        {}
        >>> all(not row.accepted for row in result.rows)
        True
    """
    return run(
        fn, args, kwargs, budget=budget, seconds=seconds, levers=levers, device=device, model=model
    )


def run(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    budget: float = 1e-2,
    seconds: float | None = None,
    levers: LeversArg = None,
    device: DeviceLike = None,
    model: torch.nn.Module | None = None,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] | None = None,
    plan: Effort | None = None,
) -> TuneResult:
    """:func:`tune` with the step's arguments given apart, a progress callback (one line
    per step), and, for tests, another clock and timing plan."""
    if not callable(fn):
        raise InvalidTypeError(f"tune(fn={short_repr(fn)}): expected the step to tune, a callable")
    budget = _positive("budget", budget)
    if seconds is not None:
        seconds = _positive("seconds", seconds)
    wanted, try_compile = _wanted(levers)
    if model is not None:
        check_model("tune", model, tuple(_model_levers(wanted)))
    elif isinstance(fn, torch.nn.Module) and refusal(fn) is None:
        model = fn  # the step is the model: its model levers are candidates too
    target = _device(device, fn, args, kwargs)
    search = Search(
        fn,
        args,
        kwargs,
        budget=budget,
        seconds=seconds,
        device=target,
        wanted=wanted,
        try_compile=try_compile,
        model=model,
        plan=plan or Effort(),
        clock=clock,
        progress=progress,
    )
    result = search.run()
    result.verdicts = verdicts_of(target, result.rows)  # did each lever timed take effect?
    return result


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(
            f"tune({name}={short_repr(value)}): expected a positive number, "
            f"got {type(value).__name__}"
        )
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise InvalidValueError(
            f"tune({name}={short_repr(value)}): expected a positive, finite number"
        )
    return number


def _wanted(levers: LeversArg) -> tuple[dict[str, Sequence[Any]] | None, bool]:
    """``levers=`` as {lever: values to try} (None: all) and whether to try compile."""
    if levers is None:
        return None, True
    items = named_levers("tune", levers, _choices())
    wanted: dict[str, Sequence[Any]] = {}
    never_tried: list[str] = []  # named alone, and the registry tries none of its values
    try_compile = False
    for name, values in items:
        if name == COMPILE:
            try_compile = values is None or bool(values)
            continue
        if not isinstance(name, str) or name not in registry.lever_names():
            raise InvalidValueError(
                f"tune(levers=...): unknown lever {short_repr(name)}; valid: {_choices()}"
            )
        spec = lever_spec(name, "tune")
        if values is None and not spec.candidates:  # deterministic: never faster
            never_tried.append(name)
            continue
        if values is None:
            wanted[name] = spec.candidates
        elif isinstance(values, (list, tuple)):
            wanted[name] = tuple(values)
        else:
            wanted[name] = (values,)
        if not wanted[name]:
            raise InvalidValueError(
                f"tune(levers={{{short_repr(name)}: {short_repr(values)}}}): no value to try; "
                f"give one or more of {spec.values}, or leave {short_repr(name)} out"
            )
        for value in wanted[name]:  # refuse a bad value now, not after the reference ran
            spec.check("tune", value, f"levers[{short_repr(name)}]")
    if not wanted and not try_compile:  # nothing would be measured, yet fp32 would "win"
        hint = "".join(
            f"; {name} has no value tune tries by itself (never faster): give values, "
            f"levers={{{short_repr(name)}: [...]}}"
            for name in never_tried
        )
        raise InvalidValueError(
            f"tune(levers={short_repr(levers)}): names nothing to try; give one or more of "
            f"{_choices()}, or None for all{hint}"
        )
    return wanted, try_compile


def _device(
    device: DeviceLike, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> torch.device:
    given = normalize_device(device, "tune")
    if given is None:
        given = _first_device([*args, *kwargs.values()])
    if given is None:
        for obj in find_state(fn, args, kwargs):
            if isinstance(obj, torch.nn.Module):
                given = _first_device(list(obj.parameters()) + list(obj.buffers()))
                if given is not None:
                    break
    target = given or default_device()
    missing = missing_cuda(target)
    if missing is not None:
        raise InvalidValueError(f"tune(device={str(target)!r}): {missing}")
    return target


def _first_device(values: Sequence[Any], depth: int = 0) -> torch.device | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            device: torch.device = value.device  # typed: Tensor.device is Any in 2.1's stubs
            return device
        if depth < 2 and isinstance(value, (list, tuple)):
            found = _first_device(value, depth + 1)
        elif depth < 2 and isinstance(value, Mapping):
            found = _first_device(list(value.values()), depth + 1)
        else:
            continue
        if found is not None:
            return found
    return None


def _choices() -> str:
    """What ``levers=`` may name: every lever (registered ones too) and compile."""
    return ", ".join(sorted((*registry.lever_names(), COMPILE)))


def _model_levers(wanted: Mapping[str, Sequence[Any]] | None) -> list[tuple[str, Any]]:
    """The model levers tune would try (every one when ``wanted`` is None), as checked
    pairs: what ``model=`` is for."""
    return [
        (spec.name, None)
        for spec in registry.specs()
        if spec.per_model and (wanted is None or spec.name in wanted)
    ]
