"""``fast_math(...)``: a frozen spec of lever values; a context manager and a decorator.

Creating a spec validates every argument and touches no torch state. Each ``with`` (and each
decorated call) opens a new ledger frame, so one spec can be reused, nested, shared between
threads and used recursively. Its plan (:func:`make_plan`, below) works out on first entry
what the levers do on the device; :mod:`.in_graph` what a spec does inside ``torch.compile``.

May import: the ledger (:mod:`speedflags._ledger`), the levers, the rank check
(:mod:`speedflags._distributed`) and the base modules; never the blocks or tools above.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import (
    TYPE_CHECKING,
    Any,
    NamedTuple,
    TypeVar,
    overload,
)

import torch

from .. import _warn
from .._hardware import DeviceLike, capabilities, default_device, missing_cuda, normalize_device
from .._hardware.cpu import emulation_cost
from .._ledger.decorate import decorate
from .._ledger.frame import Frame
from .._ledger.ledger import ledger
from .._ledger.program import LeverItem, Program
from .._ledger.scope import FrameScope
from .._short_repr import short_repr, short_str, type_name
from .._tracing import Where, hooked, is_compiling
from ..errors import (
    DeviceUnavailableWarning,
    InvalidTypeError,
    LeverUnavailableError,
    SlowPathWarning,
)
from ..levers.autocast import AUTO
from ..levers.lever_sets import document_levers
from ..levers.registry import check_levers, check_model, lever_spec, shown_levers
from ..levers.spec import LeverSpec
from .in_graph import BUILDERS, decorated_in_graph, enter_in_graph, exit_in_graph, spec_in_graph

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._distributed import FirstEntryCheck
    from ..levers.arguments import LeverArgs

__all__ = ["FastMath", "Plan", "fast_math", "make_plan", "resolve_auto"]

F = TypeVar("F", bound=Callable[..., Any])
_LEDGER = ledger()


# --- a spec's plan: what its levers do on the device it resolves to ------------------------


class Plan(NamedTuple):
    device: str
    program: Program
    refusals: tuple[str, ...]
    # (cause, message, category): said once per process and cause, on the first entry
    warnings: tuple[tuple[Any, str, type[Warning]], ...]
    # levers that cannot run in this installation (Effect.refused): refused, strict or not
    cannot: tuple[str, ...] = ()


def make_plan(
    requested: tuple[tuple[str, Any], ...],
    recommend: bool,
    strict: bool,
    device: torch.device,
    model: Any = None,
    specs: Mapping[str, LeverSpec] | None = None,
) -> Plan:
    """The plan of a spec that asked for ``requested`` (all recommended levers if
    ``recommend``), on ``device``; the model levers' for ``model``. ``specs``: the levers'
    declarations as the spec found them when it was built (a lever unregistered since
    still applies and restores)."""
    shown_device = capabilities(device).device
    no_device = missing_cuda(device)
    reasons: dict[str, str] = {}
    skipped = []
    if recommend:
        from .._recommend import recommended  # local: loaded by the first bare spec's plan

        rec = recommended(device)
        reasons = {k: f"recommended: {v}" for k, v in rec.reasons.items()}
        requested = check_levers("recommended", rec.levers)
        if not requested:
            skipped.append(("*", reasons["*"]))
    items: list[LeverItem] = []
    refusals = []
    cannot = []
    said: list[tuple[Any, str, type[Warning]]] = []
    for name, value in requested:
        note = reasons.get(name, "")
        spec = specs[name] if specs is not None and name in specs else lever_spec(name)
        lever = spec.lever(device.type, model)
        if value == AUTO:  # amp="auto": the dtype depends on the device
            value, why = resolve_auto(device)
            if value is None:
                skipped.append((name, f"{name}='auto': {why}"))
                continue
            note = f"{name}='auto' chose {lever.describe_value(value)}: {why}"
        # a model lever acts where the model's parameters are, whatever device= says
        acts_on = _model_device(model, device) if spec.per_model else device
        effect = spec.effect(value, acts_on)
        shown = f"{name}={lever.describe_value(value)!r}"
        if effect.refused:  # what is missing is an install (fp8 without torchao): refused
            cannot.append(f"{shown}: {effect.reason}")
            continue
        if not effect.effective and strict:
            refusals.append(f"{shown}: {effect.reason}")
        if effect.unsupported:  # this PyTorch would raise: recorded as skipped instead
            skipped.append((name, f"{shown}: {effect.reason}"))
            continue
        if no_device is not None and spec.per_model and acts_on.type != device.type:
            # device="cuda" without CUDA, the model on the CPU: the lever still acts there
            where = capabilities(acts_on).device
            message = (
                f"{shown} on {shown_device}: {no_device}; {name} acts on the model where its "
                f"parameters are ({where}), so it changes how the model computes there."
            )
            said.append(
                (("model elsewhere", shown_device, name), message, DeviceUnavailableWarning)
            )
            note = "; ".join(r for r in (note, f"acts on the model's device, {where}") if r)
        elif no_device is not None:  # device="cuda" without CUDA: never silent
            like = " (torch.autocast('cuda') warns and disables itself there too)" * (name == "amp")
            message = (
                f"{shown} on {shown_device}: {no_device}, so it changes nothing{like}; the "
                "block is entered and restored as usual. strict=True refuses it."
            )
            said.append((("no device", shown_device, name), message, DeviceUnavailableWarning))
        elif effect.slow:  # emulated: it works, at a fraction of the speed
            auto = " amp='auto' turns autocast on only where the dtype is native;" * (name == "amp")
            cost = f" ({emulation_cost(value)})" if isinstance(value, torch.dtype) else ""
            message = (
                f"{shown} on {shown_device} is slower than without it: {effect.reason}{cost}."
                f"{auto} strict=True refuses it."
            )
            said.append((("slow", shown_device, name, str(value)), message, SlowPathWarning))
        items.append((lever, value, "; ".join(r for r in (note, effect.reason) if r)))
    if no_device is not None and not said:  # amp="auto", a bare fast_math(): nothing applied
        message = f"fast_math on {shown_device}: {no_device}, so its levers change nothing"
        said.append((("no device", shown_device, "*"), message, DeviceUnavailableWarning))
    return Plan(shown_device, Program(items, skipped), tuple(refusals), tuple(said), tuple(cannot))


def _model_device(model: Any, default: torch.device) -> torch.device:
    """The device of the model's first parameter (or buffer), else ``default``."""
    if isinstance(model, torch.nn.Module):
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            device: torch.device = tensor.device
            return device
    return default


def resolve_auto(device: torch.device) -> tuple[torch.dtype | None, str]:
    """What ``amp="auto"`` means on ``device``: the autocast dtype (or None), and why."""
    caps = capabilities(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None, f"no autocast on {caps.device}: {caps.bf16.reason}"
    if caps.bf16:
        return torch.bfloat16, caps.bf16.reason
    if device.type == "cuda" and caps.fp16:
        return torch.float16, f"no native bf16 ({caps.bf16.reason}); {caps.fp16.reason}"
    return None, f"no native bf16 or fp16 on {caps.device}: {caps.bf16.reason}"


class FastMath(FrameScope):
    """A reusable set of lever values: ``with spec:`` or ``@spec``.

    Build one with :func:`fast_math` or a single-lever shorthand. It is immutable; every
    ``with`` and every decorated call opens its own ledger frame (reusable, reentrant,
    recursion-safe). ``with spec as frame:`` binds the :class:`~speedflags.Frame`. It is a
    :class:`~speedflags._ledger.scope.FrameScope` of the process's ledger whose levers
    are its plan: ``spec.start()``/``spec.stop()`` and ``async with spec`` work too.

    Scope: ``amp`` is thread-local; ``param_dtype``, ``memory_format`` and ``fp8`` act on
    the model given as ``model=`` (every thread calling it); every other lever (``tf32``,
    ``matmul_precision``, ``cudnn_benchmark``, ``sdpa``, ``deterministic``,
    ``reduced_precision_reduction``) is process-wide. Restores: every lever it set, to the
    exact state found on entry (for a model: each module's own class, each weight's layout,
    each layer in its own place).
    With ``check_ranks=True`` its first entry (with a process group) also checks, after
    applying the levers, that every rank runs with the same flags.

    Threads and tasks: blocks must exit in reverse order of entry within one thread or
    asyncio task (``with`` or ``async with``); blocks of different threads or tasks may
    exit in any order. A block that sets a process-wide lever (or, for tasks of one
    thread, ``amp``) differently from another thread's or task's open block warns
    (:class:`~speedflags.LeverConflictWarning`). A block held across a generator's
    ``yield`` is exited in whatever order the consumer's own blocks allow; decorate the
    generator function instead (its levers then hold while its body runs). See
    ``docs/threading.md``.

    Example:
        >>> import torch, speedflags
        >>> spec = speedflags.fast_math(cudnn_benchmark=True)
        >>> with spec:
        ...     with spec:  # reusable and reentrant: each entry is its own frame
        ...         torch.backends.cudnn.benchmark
        True
        >>> torch.backends.cudnn.benchmark
        False
    """

    __slots__ = (
        "_device",
        "_model",
        "_plan_cache",
        "_rank_check",
        "_recommend",
        "_requested",
        "_specs",
        "_strict",
    )

    def __init__(
        self,
        *,
        device: DeviceLike = None,
        strict: bool = False,
        label: str | None = None,
        check_ranks: bool = False,
        model: torch.nn.Module | None = None,
        **levers: Unpack[LeverArgs],
    ) -> None:
        # None means "leave unchanged" (so fast_math(**config) can carry blanks); the
        # registry validates and orders the rest, and refuses unknown names.
        requested = check_levers("fast_math", levers)
        check_model("fast_math", model, requested)
        self._specs = {name: lever_spec(name) for name, _ in requested}
        if not isinstance(strict, bool):
            raise InvalidTypeError(
                f"fast_math(strict={short_repr(strict)}): expected True or False, "
                f"got {type_name(strict)}"
            )
        if label is not None and not isinstance(label, str):
            raise InvalidTypeError(f"fast_math(label={short_repr(label)}): expected a str")
        if not isinstance(check_ranks, bool):
            raise InvalidTypeError(
                f"fast_math(check_ranks={short_repr(check_ranks)}): expected True or False, got "
                f"{type_name(check_ranks)}"
            )
        self.ledger = _LEDGER
        self._requested: tuple[tuple[str, Any], ...] = requested
        self._recommend = not levers  # a bare fast_math(): the device's recommended levers
        self._device = normalize_device(device, "fast_math")
        self._strict = strict
        self._model = model
        shown = shown_levers(levers)
        if model is not None:
            shown.append(f"model={type(model).__name__}")
        if device is not None:
            shown.append(f"device={str(self._device)!r}")
        if strict:
            shown.append("strict=True")
        if check_ranks:
            shown.append("check_ranks=True")
        self._label = label if label is not None else f"fast_math({', '.join(shown)})"
        # Resolved on first entry (the device, and so the plan, never changes in a process).
        self._plan_cache: Plan | None = None
        # FrameScope's (program, device): set once a frame opened with nothing left to
        # check on entry
        self._ready = None
        self._rank_check: FirstEntryCheck | None = None
        if check_ranks:
            # torch.distributed is imported only by specs that check ranks
            from .._distributed import FirstEntryCheck

            self._rank_check = FirstEntryCheck()

    # --- what it will do ---------------------------------------------------------------

    @property
    def levers(self) -> dict[str, Any]:
        """The requested lever values (empty for a bare ``fast_math()``: see ``recommended``)."""
        return {name: self._specs[name].describe_value(value) for name, value in self._requested}

    @property
    def model(self) -> torch.nn.Module | None:
        """The model the model levers act on (``param_dtype``, ``memory_format``, ``fp8``), or
        None."""
        return self._model

    def __repr__(self) -> str:
        return f"<speedflags {short_str(self._label)}>"

    def _plan(self) -> Plan:
        plan = self._plan_cache
        if plan is None:
            device = self._device if self._device is not None else default_device()
            plan = self._plan_cache = make_plan(
                self._requested, self._recommend, self._strict, device, self._model, self._specs
            )
            if not plan.refusals and not plan.cannot:
                for cause, message, category in plan.warnings:
                    _warn.warn_once(cause, message, category)
        if plan.cannot:
            raise LeverUnavailableError(
                f"{short_str(self._label)}: cannot run here: "
                + "; ".join(plan.cannot)
                + ". Nothing was changed."
            )
        if plan.refusals:
            raise LeverUnavailableError(
                f"{short_str(self._label)}: strict=True refuses levers that have no native "
                f"effect on {plan.device}: " + "; ".join(plan.refusals) + ". Nothing was changed."
            )
        return plan

    # --- frames (FrameScope: with, async with, start/stop, and the interrupt handling) ---

    def open_frame(self, label: str, where: Where) -> Frame:
        """Open a frame with this spec's levers (and the first-entry rank check)."""
        ready = self._ready
        if ready is not None:  # every entry after the first: the plan alone
            return _LEDGER.open(ready[0], label, where, self, ready[1])
        plan = self._plan()
        frame = _LEDGER.open(plan.program, label, where, self, plan.device)
        rank_check = self._rank_check
        if rank_check is not None and not rank_check.done:
            # after the levers are applied; a mismatch closes the frame before raising
            rank_check(label, lambda: frame.close(where))
        else:
            self._ready = (plan.program, plan.device)
        return frame

    def enter_in_graph(self) -> Frame:
        return enter_in_graph(self)  # type: ignore[no-any-return]

    def exit_in_graph(self) -> None:
        exit_in_graph(self)

    # --- decorator -----------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        label = f"{getattr(func, '__qualname__', repr(func))}: {self._label}"
        in_graph = decorated_in_graph(self, label, func)
        return decorate(func, self, "fast_math", label, in_graph=in_graph)


BUILDERS["fast_math"] = FastMath


@overload
def fast_math(func: F, /) -> F: ...


@overload
def fast_math(
    *,
    device: DeviceLike = ...,
    strict: bool = ...,
    label: str | None = ...,
    check_ranks: bool = ...,
    model: torch.nn.Module | None = ...,
    **levers: Unpack[LeverArgs],
) -> FastMath: ...


def fast_math(
    func: Callable[..., Any] | None = None,
    /,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
    check_ranks: bool = False,
    model: torch.nn.Module | None = None,
    **levers: Unpack[LeverArgs],
) -> Any:
    """Switch PyTorch's fast paths on for a block or a function, and restore them exactly after.

    Every lever defaults to "leave unchanged" (``None`` means the same). A bare
    ``fast_math()`` applies the recommended levers for the device (see
    :func:`speedflags.recommended` and the table in ``docs/levers.md``).

    Args:
        **levers: one keyword per lever of :data:`speedflags.levers.REGISTRY` (below);
            ``None`` or absent leaves the lever unchanged.
        device: the device the levers target (default: CUDA if available, else CPU).
        strict: refuse (``LeverUnavailableError``) a lever with no native effect on the
            device instead of applying it and recording why it has none. A value this
            PyTorch refuses on the device (fp16 CPU autocast on PyTorch 2.1) is never
            applied: without ``strict`` it is recorded as skipped, with the reason.
        label: the frame's name in the ledger's history.
        check_ranks: at the first entry (the first one while a ``torch.distributed``
            process group exists), after applying the levers, check that every rank runs
            with the same flags (:func:`speedflags.check_ranks`); a mismatch closes the
            frame and raises :class:`~speedflags.RankMismatchError` on every rank.
        model: the ``nn.Module`` the model levers (``param_dtype``, ``memory_format``, ``fp8``) act
            on; required with them, refused without them.

    Returns:
        A :class:`FastMath` spec, or, when given a function (``@fast_math``), the function
        wrapped so that the levers hold while its body runs.

    Raises:
        InvalidValueError, InvalidTypeError: at construction, for a bad argument.
        MixedTF32APIError: on entry, if PyTorch's TF32 APIs are already mixed.
        RankMismatchError: with ``check_ranks=True``, at the first entry, if ranks differ.

    Decorating: a plain function gets the levers for each call. Generators, coroutines and
    async generators get them per step: while their body runs, not while they are suspended
    at ``yield``/``await`` (so other code on the event loop never sees them). Prefer this
    to a ``with`` block around a ``yield``.

    Threads and tasks: ``with`` and ``async with`` blocks nest per thread and per asyncio
    task; blocks of different threads or tasks may exit in any order, and one that
    overrides another's process-wide lever warns (:class:`~speedflags.LeverConflictWarning`).
    See ``docs/threading.md``.

    Inside a function given to ``torch.compile``: an ``amp``-only spec is traced into the
    graph as ``torch.autocast`` (and is one there: ``with ... as frame`` binds ``None``);
    any other runs its block eagerly, a graph break around it, or, with ``fullgraph=True``,
    raises :class:`~speedflags.LeverInGraphError`. See ``docs/inside_compile.md``.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.fast_math(matmul_precision="medium"):
        ...     torch.get_float32_matmul_precision()
        'medium'
        >>> torch.get_float32_matmul_precision()
        'highest'

    Levers:
    {levers}
    """
    if func is None and (is_compiling() or hooked()):  # inside torch.compile
        options: dict[str, Any] = {
            "device": device,
            "strict": strict,
            "label": label,
            "check_ranks": check_ranks,
        }
        if model is not None:
            options["model"] = model
        return spec_in_graph("fast_math", (), {**options, **levers})
    spec = FastMath(
        device=device, strict=strict, label=label, check_ranks=check_ranks, model=model, **levers
    )
    if func is None:
        return spec
    if not callable(func):
        raise InvalidTypeError(
            f"fast_math({short_repr(func)}): takes keyword arguments only "
            "(fast_math(tf32=True)) or a function to decorate"
        )
    return spec(func)


document_levers(fast_math)
document_levers(FastMath.__init__)
