"""``fast_math(...)``: a frozen spec of lever values; a context manager and a decorator.

Creating a spec validates every argument and touches no torch state. Each ``with`` (and each
decorated call) opens a new ledger frame, so one spec can be reused, nested, shared between
threads and used recursively.
"""

from __future__ import annotations

import sys
from typing import (
    Any,
    Callable,
    Dict,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    overload,
)

import torch

from . import _warn
from ._decorate import decorate
from ._ledger import Frame, LeverItem, Program, Where, ledger
from ._sentinel import UNSET, _Unset
from .distributed import FirstEntryCheck
from .errors import (
    InvalidTypeError,
    InvalidValueError,
    LeverUnavailableError,
    SlowPathWarning,
)
from .hardware import DeviceLike, capabilities, default_device, normalize_device
from .levers import LEVER_NAMES, PROCESS_LEVERS, autocast_lever
from .levers.autocast import AUTO, validate_amp
from .levers.cudnn import CudnnBenchmarkLever
from .levers.precision import MatmulPrecisionLever
from .levers.sdpa import SdpaLever
from .levers.tf32 import TF32Lever
from .recommend import recommended

__all__ = [
    "FastMath",
    "autocast",
    "cudnn_benchmark",
    "fast_math",
    "matmul_precision",
    "sdpa_backend",
    "tf32",
]

F = TypeVar("F", bound=Callable[..., Any])
_LEDGER = ledger()

_VALIDATORS: Dict[str, Callable[[object], Any]] = {
    "tf32": TF32Lever.validate,
    "matmul_precision": MatmulPrecisionLever.validate,
    "cudnn_benchmark": CudnnBenchmarkLever.validate,
    "sdpa": SdpaLever.validate,
    "amp": validate_amp,
}

SdpaArg = Union[str, Sequence[Any], Any]
AmpArg = Union[str, torch.dtype, bool]


def _checked(call: str, arg: str, value: object, validator: Callable[[object], Any]) -> Any:
    # Lever validators say what is wrong; this says where: "fast_math(amp='bf17'): ...".
    try:
        return validator(value)
    except InvalidValueError as exc:
        raise InvalidValueError(f"{call}({arg}={value!r}): {exc}") from None
    except InvalidTypeError as exc:
        raise InvalidTypeError(f"{call}({arg}={value!r}): {exc}") from None


class _Plan(NamedTuple):
    device: str
    program: Program
    refusals: Tuple[str, ...]
    slow: Tuple[Tuple[Any, str], ...]


class FastMath:
    """A reusable set of lever values: ``with spec:`` or ``@spec``.

    Build one with :func:`fast_math` or a single-lever shorthand. It is immutable; every
    ``with`` and every decorated call opens its own ledger frame (reusable, reentrant,
    recursion-safe). ``with spec as frame:`` binds the :class:`~speedflags.Frame`.

    Scope: ``tf32``, ``matmul_precision``, ``cudnn_benchmark`` and ``sdpa`` are
    process-wide; ``amp`` is thread-local. Restores: every lever it set, to the exact state
    found on entry. With ``check_ranks=True`` its first entry (with a process group) also
    checks, after applying the levers, that every rank runs with the same flags.

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
        "_label",
        "_plan_cache",
        "_rank_check",
        "_recommend",
        "_requested",
        "_strict",
    )

    def __init__(
        self,
        *,
        tf32: Union[bool, _Unset, None] = UNSET,
        matmul_precision: Union[str, _Unset, None] = UNSET,
        cudnn_benchmark: Union[bool, _Unset, None] = UNSET,
        sdpa: Union[SdpaArg, _Unset, None] = UNSET,
        amp: Union[AmpArg, _Unset, None] = UNSET,
        device: DeviceLike = None,
        strict: bool = False,
        label: Optional[str] = None,
        check_ranks: bool = False,
    ) -> None:
        given = {
            "tf32": tf32,
            "matmul_precision": matmul_precision,
            "cudnn_benchmark": cudnn_benchmark,
            "sdpa": sdpa,
            "amp": amp,
        }
        requested = []
        for name in LEVER_NAMES:
            raw = given[name]
            if raw is UNSET or raw is None:  # None: leave unchanged, for fast_math(**config)
                continue
            requested.append((name, _checked("fast_math", name, raw, _VALIDATORS[name])))
        values = dict(requested)
        tf32_value = values.get("tf32")
        precision = values.get("matmul_precision")
        if (
            tf32_value is not None
            and precision is not None
            and tf32_value != (precision != "highest")
        ):
            fix = "tf32=True" if precision != "highest" else "matmul_precision='high' or 'medium'"
            raise InvalidValueError(
                f"fast_math(tf32={tf32_value!r}, matmul_precision={precision!r}): contradictory: "
                f"matmul precision {precision!r} turns cuBLAS TF32 "
                f"{'on' if precision != 'highest' else 'off'}; use {fix}, or leave one of them out"
            )
        if not isinstance(strict, bool):
            raise InvalidTypeError(
                f"fast_math(strict={strict!r}): expected True or False, got {type(strict).__name__}"
            )
        if label is not None and not isinstance(label, str):
            raise InvalidTypeError(f"fast_math(label={label!r}): expected a str")
        if not isinstance(check_ranks, bool):
            raise InvalidTypeError(
                f"fast_math(check_ranks={check_ranks!r}): expected True or False, got "
                f"{type(check_ranks).__name__}"
            )
        self._requested: Tuple[Tuple[str, Any], ...] = tuple(requested)
        self._recommend = all(v is UNSET for v in given.values())
        self._device = normalize_device(device, "fast_math")
        self._strict = strict
        shown = [f"{n}={given[n]!r}" for n in LEVER_NAMES if given[n] is not UNSET]
        if device is not None:
            shown.append(f"device={str(self._device)!r}")
        if strict:
            shown.append("strict=True")
        if check_ranks:
            shown.append("check_ranks=True")
        self._label = label if label is not None else f"fast_math({', '.join(shown)})"
        # Resolved on first entry (the device, and so the plan, never changes in a process).
        self._plan_cache: Optional[_Plan] = None
        self._rank_check = FirstEntryCheck() if check_ranks else None

    # --- what it will do ---------------------------------------------------------------

    @property
    def levers(self) -> Dict[str, Any]:
        """The requested lever values (empty for a bare ``fast_math()``: see ``recommended``)."""
        return {name: _shown(name, value) for name, value in self._requested}

    @property
    def label(self) -> str:
        return self._label

    def __repr__(self) -> str:
        return f"<speedflags {self._label}>"

    def _plan(self) -> _Plan:
        plan = self._plan_cache
        if plan is None:
            device = self._device if self._device is not None else default_device()
            plan = self._plan_cache = self._make_plan(device)
            for cause, message in plan.slow:
                _warn.warn_once(cause, message, SlowPathWarning)
        if plan.refusals:
            raise LeverUnavailableError(
                f"{self._label}: strict=True refuses levers that have no native effect on "
                f"{plan.device}: " + "; ".join(plan.refusals) + ". Nothing was changed."
            )
        return plan

    def _make_plan(self, device: torch.device) -> _Plan:
        shown_device = capabilities(device).device
        requested = self._requested
        reasons: Dict[str, str] = {}
        skipped = []
        if self._recommend:
            rec = recommended(device)
            reasons = {k: f"recommended: {v}" for k, v in rec.reasons.items()}
            requested = tuple(
                (name, _VALIDATORS[name](rec.levers[name]))
                for name in LEVER_NAMES
                if name in rec.levers
            )
            if not requested:
                skipped.append(("*", reasons["*"]))
        items: list[LeverItem] = []
        refusals = []
        slow = []
        for name, value in requested:
            note = reasons.get(name, "")
            if name == "amp":
                lever: Any = autocast_lever(device.type)
                if value == AUTO:
                    value, why = _resolve_auto(device)
                    if value is None:
                        skipped.append(("amp", f"amp='auto': {why}"))
                        continue
                    note = f"amp='auto' chose {lever.describe_value(value)}: {why}"
            else:
                lever = PROCESS_LEVERS[name]
            effect = lever.available(value, device)
            shown = f"{name}={lever.describe_value(value)!r}"
            if not effect.effective and self._strict:
                refusals.append(f"{shown}: {effect.reason}")
            if effect.slow:
                slow.append(
                    (
                        (name, shown_device, str(value)),
                        f"{shown} on {shown_device}: {effect.reason}. Use amp='bf16', or "
                        "strict=True to refuse it.",
                    )
                )
            items.append((lever, value, "; ".join(r for r in (note, effect.reason) if r)))
        return _Plan(shown_device, Program(items, skipped), tuple(refusals), tuple(slow))

    # --- context manager -----------------------------------------------------------------

    def _open(self, label: str, where: Where) -> Frame:
        """Open a frame with this spec's levers (and the first-entry rank check)."""
        plan = self._plan()
        frame = _LEDGER.open(plan.program, label, where, self, plan.device)
        rank_check = self._rank_check
        if rank_check is not None and not rank_check.done:
            # after the levers are applied; a mismatch closes the frame before raising
            rank_check(label, lambda: _LEDGER.close(frame, where))
        return frame

    def __enter__(self) -> Frame:
        caller = sys._getframe(1)
        return self._open(self._label, (caller.f_code.co_filename, caller.f_lineno))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        caller = sys._getframe(1)
        _LEDGER.close_innermost(self, (caller.f_code.co_filename, caller.f_lineno))

    # ``async with``: the same frame, entered and exited in the running task's context (a
    # plain ``with`` inside a coroutine is the same thing; this spelling reads as what it is).
    async def __aenter__(self) -> Frame:
        caller = sys._getframe(1)
        return self._open(self._label, (caller.f_code.co_filename, caller.f_lineno))

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        caller = sys._getframe(1)
        _LEDGER.close_innermost(self, (caller.f_code.co_filename, caller.f_lineno))

    # --- decorator -----------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        label = f"{getattr(func, '__qualname__', repr(func))}: {self._label}"
        the_ledger = _LEDGER
        open_spec = self._open

        def open_frame(where: Any) -> Frame:
            return open_spec(label, where)

        def close_frame(frame: Frame, where: Any) -> None:
            the_ledger.close(frame, where)

        return decorate(func, open_frame, close_frame, "fast_math")


def _shown(name: str, value: Any) -> Any:
    if name in PROCESS_LEVERS:
        return PROCESS_LEVERS[name].describe_value(value)
    if value is None or value == AUTO:
        return False if value is None else AUTO
    return str(value).replace("torch.", "")


def _resolve_auto(device: torch.device) -> Tuple[Optional[torch.dtype], str]:
    caps = capabilities(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None, f"no autocast on {caps.device}: {caps.bf16.reason}"
    if caps.bf16:
        return torch.bfloat16, caps.bf16.reason
    if device.type == "cuda" and caps.fp16:
        return torch.float16, f"no native bf16 ({caps.bf16.reason}); {caps.fp16.reason}"
    return None, f"no native bf16 or fp16 on {caps.device}: {caps.bf16.reason}"


@overload
def fast_math(func: F, /) -> F: ...


@overload
def fast_math(
    *,
    tf32: Union[bool, _Unset, None] = ...,
    matmul_precision: Union[str, _Unset, None] = ...,
    cudnn_benchmark: Union[bool, _Unset, None] = ...,
    sdpa: Union[SdpaArg, _Unset, None] = ...,
    amp: Union[AmpArg, _Unset, None] = ...,
    device: DeviceLike = ...,
    strict: bool = ...,
    label: Optional[str] = ...,
    check_ranks: bool = ...,
) -> FastMath: ...


def fast_math(
    func: Optional[Callable[..., Any]] = None,
    /,
    *,
    tf32: Union[bool, _Unset, None] = UNSET,
    matmul_precision: Union[str, _Unset, None] = UNSET,
    cudnn_benchmark: Union[bool, _Unset, None] = UNSET,
    sdpa: Union[SdpaArg, _Unset, None] = UNSET,
    amp: Union[AmpArg, _Unset, None] = UNSET,
    device: DeviceLike = None,
    strict: bool = False,
    label: Optional[str] = None,
    check_ranks: bool = False,
) -> Any:
    """Switch PyTorch's fast paths on for a block or a function, and restore them exactly after.

    Every lever defaults to "leave unchanged" (``None`` means the same). A bare
    ``fast_math()`` applies the recommended levers for the device (see
    :func:`speedflags.recommended` and the README's table).

    Args:
        tf32: TF32 for cuBLAS matmuls and cuDNN conv/rnn. Process scope.
        matmul_precision: ``"highest"``, ``"high"`` or ``"medium"``, as
            ``torch.set_float32_matmul_precision`` (``"medium"`` also routes CPU float32
            matmuls through oneDNN bf16). Process scope.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` and nothing else. Process scope.
        sdpa: a backend (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``) or an ordered
            sequence of them: preferred SDPA kernels, with ``math`` kept as the fallback so
            no input fails with "No available kernel". Process scope.
        amp: ``"bf16"``, ``"fp16"``, ``"auto"``, ``torch.bfloat16``, ``torch.float16`` or
            ``False`` (autocast off): autocast on ``device``. Thread scope.
        device: the device the levers target (default: CUDA if available, else CPU).
        strict: refuse (``LeverUnavailableError``) a lever with no native effect on the
            device instead of applying it and recording why it has none.
        label: the frame's name in the ledger's history.
        check_ranks: at the first entry (the first one while a ``torch.distributed``
            process group exists), after applying the levers, check that every rank runs
            with the same flags (:func:`speedflags.check_ranks`); a mismatch closes the
            frame and raises :class:`~speedflags.RankMismatchError` on every rank.

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

    Example:
        >>> import torch, speedflags
        >>> with speedflags.fast_math(matmul_precision="medium"):
        ...     torch.get_float32_matmul_precision()
        'medium'
        >>> torch.get_float32_matmul_precision()
        'highest'
    """
    spec = FastMath(
        tf32=tf32,
        matmul_precision=matmul_precision,
        cudnn_benchmark=cudnn_benchmark,
        sdpa=sdpa,
        amp=amp,
        device=device,
        strict=strict,
        label=label,
        check_ranks=check_ranks,
    )
    if func is None:
        return spec
    if not callable(func):
        raise InvalidTypeError(
            f"fast_math({func!r}): takes keyword arguments only (fast_math(tf32=True)) or a "
            "function to decorate"
        )
    return spec(func)


def tf32(enabled: bool = True, *, strict: bool = False) -> FastMath:
    """TF32 on (or off) for cuBLAS matmuls and cuDNN conv/rnn: ``fast_math(tf32=enabled)``.

    Scope: process. Restores every getter of both TF32 API families.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.tf32():
        ...     torch.backends.cuda.matmul.allow_tf32
        True
    """
    value = _checked("tf32", "enabled", enabled, TF32Lever.validate)
    return FastMath(tf32=value, strict=strict, label=f"tf32({value!r})")


def matmul_precision(value: str, *, strict: bool = False) -> FastMath:
    """Float32 matmul precision for a block: ``fast_math(matmul_precision=value)``.

    Scope: process. Restores the legacy precision and the cuBLAS and oneDNN matmul nodes.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.matmul_precision("high"):
        ...     torch.get_float32_matmul_precision()
        'high'
    """
    checked = _checked("matmul_precision", "value", value, MatmulPrecisionLever.validate)
    return FastMath(matmul_precision=checked, strict=strict, label=f"matmul_precision({checked!r})")


def cudnn_benchmark(enabled: bool = True, *, strict: bool = False) -> FastMath:
    """``torch.backends.cudnn.benchmark`` for a block, and nothing else.

    Scope: process. Restores the previous ``benchmark`` value; ``enabled``,
    ``deterministic`` and TF32 are never touched.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.cudnn_benchmark():
        ...     torch.backends.cudnn.benchmark
        True
    """
    value = _checked("cudnn_benchmark", "enabled", enabled, CudnnBenchmarkLever.validate)
    return FastMath(cudnn_benchmark=value, strict=strict, label=f"cudnn_benchmark({value!r})")


def sdpa_backend(*backends: Any, strict: bool = False) -> FastMath:
    """Preferred SDPA kernels, in order: ``fast_math(sdpa=backends)``.

    The math kernel stays enabled as the fallback, so inputs the preferred kernels cannot
    take still run. Scope: process. Restores every backend flag and the priority order.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.sdpa_backend("math"):
        ...     torch.backends.cuda.flash_sdp_enabled()
        False
    """
    given: Any = backends[0] if len(backends) == 1 else backends
    shown = ", ".join(repr(b) for b in backends)
    value = _checked("sdpa_backend", "backends", given, SdpaLever.validate)
    return FastMath(sdpa=value, strict=strict, label=f"sdpa_backend({shown})")


def autocast(dtype: AmpArg, device: DeviceLike = None, *, strict: bool = False) -> FastMath:
    """Autocast in ``dtype`` on ``device`` for a block: ``fast_math(amp=dtype, device=device)``.

    Scope: thread (like ``torch.autocast``). Restores the thread's autocast flag and dtype.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.autocast("bf16", device="cpu"):
        ...     torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")
        (torch.bfloat16, True)
    """
    _checked("autocast", "dtype", dtype, validate_amp)
    label_device = (
        f", device={str(normalize_device(device, 'autocast'))!r}" if device is not None else ""
    )
    return FastMath(
        amp=dtype, device=device, strict=strict, label=f"autocast({dtype!r}{label_device})"
    )
