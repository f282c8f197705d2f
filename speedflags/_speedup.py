"""``@speedup``: the levers of ``fast_math`` around every call of a train (or eval) step,
with optional ``torch.compile`` that falls back to eager instead of breaking the step, and
optional ``torch.inference_mode``.

The levers go through the same ledger frames as ``fast_math`` (one frame per call, restored
exactly, recorded); compiling is :mod:`speedflags._compile.guarded`'s job.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from ._fast_math import FastMath
from ._fast_math.in_graph import step_in_graph
from ._hardware import DeviceLike
from ._ledger.decorate import decorate
from ._short_repr import short_repr, type_name
from .errors import InvalidTypeError, InvalidValueError
from .levers.lever_sets import document_levers
from .levers.registry import shown_levers

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._compile.graphed import GraphedStep
    from ._compile.guarded import GuardedCompile
    from ._speedup_stats import SpeedupStats
    from .levers.arguments import LeverArgs

__all__ = ["speedup"]

F = TypeVar("F", bound=Callable[..., Any])


class _Speedup:
    """A validated ``speedup(...)``: call it on a function to decorate it."""

    __slots__ = ("_compile", "_cuda_graphs", "_device", "_fast", "_inference", "_label", "_strict")

    def __init__(
        self,
        levers: LeverArgs,
        device: DeviceLike,
        strict: bool,
        compile: object,
        inference: object,
        check_ranks: object = False,
        model: torch.nn.Module | None = None,
        cuda_graphs: object = False,
    ) -> None:
        from ._compile.options import compile_options  # local: not loaded by import speedflags

        options = compile_options(compile)
        graphs = _cuda_graphs_option(cuda_graphs)
        if not isinstance(inference, bool):
            raise InvalidTypeError(
                f"speedup(inference={short_repr(inference)}): expected True or False, "
                f"got {type_name(inference)}"
            )
        shown = shown_levers(levers)
        if model is not None:
            shown.append(f"model={type(model).__name__}")
        if device is not None:
            shown.append(f"device={str(device)!r}")
        if strict is True:
            shown.append("strict=True")
        if options is not None:
            shown.append(f"compile={compile!r}")
        if graphs:
            shown.append("cuda_graphs=True")
        if inference:
            shown.append("inference=True")
        if check_ranks is True:
            shown.append("check_ranks=True")
        self._label = f"speedup({', '.join(shown)})"
        try:
            self._fast = FastMath(
                **levers,
                device=device,
                strict=strict,
                label=self._label,
                check_ranks=check_ranks,  # type: ignore[arg-type]  # FastMath validates it
                model=model,
            )
        except (InvalidValueError, InvalidTypeError) as exc:
            # FastMath names the argument and its valid values; say which call it was.
            message = str(exc)
            if message.startswith("fast_math("):
                message = "speedup(" + message[len("fast_math(") :]
            raise type(exc)(message) from None
        self._compile = options
        self._inference = inference
        self._cuda_graphs = graphs
        self._device = device
        self._strict = strict
        if graphs:  # refuse what contradicts CUDA graphs now, not at the first call
            from ._compile.graph_policy import graph_options

            graph_options(options, self._label)

    def __repr__(self) -> str:
        return f"<speedflags {self._label}>"

    def __call__(self, func: F) -> F:
        if isinstance(func, (staticmethod, classmethod)):
            return type(func)(self(func.__func__))
        if isinstance(func, type) or not callable(func):
            return decorate(func, self._fast, "speedup", "")  # raises its usual error
        label = f"{getattr(func, '__qualname__', repr(func))}: {self._label}"
        plain = not (
            inspect.isgeneratorfunction(func)
            or inspect.iscoroutinefunction(func)
            or inspect.isasyncgenfunction(func)
        )
        guarded: GuardedCompile | GraphedStep | None = None
        if (self._compile is not None or self._cuda_graphs) and not plain:
            what = "compile=..." if self._compile is not None else "cuda_graphs=True"
            raise InvalidTypeError(
                f"speedup({what}) cannot compile {func.__qualname__!r}: torch.compile "
                "compiles plain functions, not generator or coroutine functions; compile "
                f"the function it calls, or leave {what.split('=')[0]} out"
            )
        if self._cuda_graphs:
            from ._compile.graphed import GraphedStep  # local: compile/ loads with cuda_graphs=

            guarded = GraphedStep(
                func, self._compile, label, self._device, self._strict, self._label
            )
        elif self._compile is not None:
            from ._compile.guarded import GuardedCompile  # local: compile/ loads with compile=

            guarded = GuardedCompile(func, self._compile, label)
        from ._speedup_stats import SpeedupStats  # local: loaded with the first @speedup step

        stats = SpeedupStats(self._fast, guarded, self._inference)
        if plain:
            wrapper = self._plain(func, guarded, label, stats)
        else:
            wrapper = self._stepped(func, label, stats)
        wrapper.stats = stats  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    def _plain(
        self,
        func: Callable[..., Any],
        guarded: GuardedCompile | GraphedStep | None,
        label: str,
        stats: SpeedupStats,
    ) -> Callable[..., Any]:
        # The hot path: one frame per call (FastMath.open_frame: the plan, the ledger frame
        # and check_ranks at the first entry), the same wrapper as @fast_math's.
        target: Callable[..., Any] = func if guarded is None else guarded
        if self._inference:
            target = _in_inference_mode(target)
        fast = self._fast
        in_graph = step_in_graph(fast, label, target, stats, func)  # inside torch.compile
        return decorate(func, fast, "speedup", label, in_graph=in_graph, call=target,
                        counter=stats)  # fmt: skip

    def _stepped(self, func: Callable[..., Any], label: str, stats: SpeedupStats) -> Any:
        # Generators and coroutines: the levers (and inference mode) hold per step.
        guard = _inference_guard if self._inference else None
        return decorate(func, self._fast, "speedup", label, step_guard=guard, counter=stats)


# torch._C's guard is entered and exited in C: no interruption can land between the mode's
# change and the with statement's hold on it, as one can in torch.inference_mode's Python
# __enter__ and __exit__ (docs/architecture.md, "Interrupts, signals and fork").
_C_INFERENCE_MODE: Any = getattr(torch._C, "_InferenceMode", None)  # type: ignore[attr-defined, unused-ignore]


def _cuda_graphs_option(value: object) -> bool:
    if value is False:  # the usual case: nothing of compile/ loaded
        return False
    from ._compile.graph_policy import cuda_graphs_option

    return cuda_graphs_option(value)


def _inference_guard() -> Any:
    """A context manager that turns inference mode on (for this thread) and back off."""
    if _C_INFERENCE_MODE is None:  # pragma: no cover - every supported PyTorch has it
        return torch.inference_mode()
    return _C_INFERENCE_MODE(True)


def _in_inference_mode(func: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _inference_guard():
            return func(*args, **kwargs)

    return run


@overload
def speedup(func: F, /) -> F: ...


@overload
def speedup(
    *,
    device: DeviceLike = ...,
    strict: bool = ...,
    compile: bool | dict[str, Any] = ...,
    inference: bool = ...,
    check_ranks: bool = ...,
    model: torch.nn.Module | None = ...,
    cuda_graphs: bool = ...,
    **levers: Unpack[LeverArgs],
) -> Callable[[F], F]: ...


def speedup(
    func: Callable[..., Any] | None = None,
    /,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    compile: bool | dict[str, Any] = False,
    inference: bool = False,
    check_ranks: bool = False,
    model: torch.nn.Module | None = None,
    cuda_graphs: bool = False,
    **levers: Unpack[LeverArgs],
) -> Any:
    """Decorate a train (or eval) step: fast paths on for every call, restored after it.

    A bare ``@speedup``, or one given no lever argument (``@speedup(compile=True)``),
    applies the device's recommended levers: the same table as a bare ``fast_math()`` (see
    :func:`speedflags.recommended`); pass ``amp=False`` and the like to keep a lever off.
    The lever arguments are ``fast_math``'s and mean the same; each call opens one ledger
    frame, exactly as ``@fast_math`` does, and restores every lever when the call returns
    or raises.

    Args:
        **levers: as in :func:`speedflags.fast_math` (one keyword per lever of the
            registry; the "Levers" section below).
        device: as in :func:`speedflags.fast_math`.
        strict: as in :func:`speedflags.fast_math`.
        compile: ``True``, or a dict of ``torch.compile`` options (``mode``, ``dynamic``,
            ``fullgraph``, ``backend``, ``options``, ...). Compiled lazily at the first
            call, once per function (methods share one artefact) and state of the levers
            dynamo does not guard (SDPA, cuDNN, oneDNN: ``docs/compile.md``). If the compiler stack
            (dynamo, AOT autograd, inductor, the backend) fails, at the first call, at a
            later recompile or for the backward graph, the call still completes eagerly
            with nothing run twice, a :class:`~speedflags.CompileFallbackWarning` is
            emitted once (and logged to the ``speedflags`` logger), the ledger's history
            records it, and later calls run eagerly without retrying. The step's own
            errors are not compiler failures, even where dynamo meets them first (a shape
            mismatch): each call raises what the step raises without compile, unchanged,
            and the function stays compiled. No compiler setting outlives the call.
        inference: run each call under ``torch.inference_mode()``.
        check_ranks: at the first call made while a ``torch.distributed`` process group
            exists, after the levers are applied, check that every rank runs with the same
            flags (:func:`speedflags.check_ranks`); a mismatch restores the call's levers and
            raises :class:`~speedflags.RankMismatchError` on every rank. Checked once.
        model: the ``nn.Module`` the model levers (``param_dtype``, ``memory_format``) act on
            for each call, as in ``fast_math``.
        cuda_graphs: ``True`` to compile the step with CUDA graphs (torch.compile's own:
            inductor's graph trees record each compiled graph once and replay it as one
            launch), for steps bound by kernel launches; implies ``compile`` (with the
            options given there, if any). Around the graphs: an optimizer's learning rate
            must be a tensor on its parameters' device, so that a scheduler's new values
            neither compile the step again nor stay frozen in a graph (else
            :class:`~speedflags.CudaGraphsError` before the call runs, naming the fix);
            graphs are recorded for the first 8 distinct input shapes, later shapes run
            eagerly with one :class:`~speedflags.CudaGraphsWarning` naming the shapes seen;
            the tensors a graphed call returns are copies, safe to keep; inductor's
            "skipping cudagraphs" reasons go to ``.stats.cuda_graphs``, the history and a
            warning. On a CPU or without CUDA it has no effect (recorded; ``strict=True``
            raises :class:`~speedflags.LeverUnavailableError`). ``docs/cuda_graphs.md``.

    Returns:
        The decorated function (``functools.wraps`` metadata, ``__wrapped__`` is the
        original) with a live :class:`SpeedupStats` as ``.stats``; or, called with
        arguments only, the decorator.

    Raises:
        InvalidValueError, InvalidTypeError: at decoration, for a bad argument, before any
            torch state is touched (a ``compile`` backend name is checked against
            dynamo's registry; a bad ``mode`` is reported by torch at the first call,
            as a fallback); ``cuda_graphs`` other than ``True``/``False``, or with
            ``compile`` options that turn CUDA graphs off or use another backend.

    Scope: as ``fast_math``: ``amp`` is thread-local, the other levers process-wide, each
    for the duration of a call. Restores every lever after every call, also when it
    raises; the compiler settings it needs (``suppress_errors`` for the call,
    ``force_non_lazy_backward_lowering`` while a graph compiles) are thread-local and put
    back too.

    Example:
        >>> import torch, speedflags
        >>> @speedflags.speedup(amp="bf16", device="cpu")
        ... def step(x):
        ...     return (x @ x).dtype
        >>> step(torch.ones(2, 2))
        torch.bfloat16
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype, step.stats.calls  # restored after it
        (torch.float32, 1)

    Levers:
    {levers}
    """
    spec = _Speedup(levers, device, strict, compile, inference, check_ranks, model, cuda_graphs)
    if func is None:
        return spec
    if not callable(func):
        raise InvalidTypeError(
            f"speedup({short_repr(func)}): takes keyword arguments only (speedup(amp='bf16')) or a "
            "function to decorate"
        )
    return spec(func)


document_levers(speedup)
