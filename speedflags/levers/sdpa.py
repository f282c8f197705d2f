"""The ``sdpa`` lever: which scaled-dot-product-attention kernels may run, in priority order.

A preference, never a trap: the preferred backends are enabled and put first in PyTorch's
SDPA priority order, and the ``math`` backend always stays enabled after them. The math
kernel accepts every input, so an input the preferred kernel cannot take (fp32 for flash,
an unsupported head size, a mask) falls back to it instead of raising "No available kernel".
Backends not named (other than math) are disabled. Exit restores every enabled flag and the
exact priority order (``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch._C as torch_C

from .._hardware import capabilities
from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from ._base import UNSET, Effect, SimpleLever, verified
from .spec import Shorthand, declare

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

BACKENDS = ("flash", "efficient", "cudnn", "math")
# Every backend whose flag is part of the state (overrideable: privateuse devices; never
# touched, but restored if code inside a block changes it).
_ALL = ("flash", "efficient", "cudnn", "math", "overrideable")
_GETTERS = {
    "flash": "_get_flash_sdp_enabled",
    "efficient": "_get_mem_efficient_sdp_enabled",
    "cudnn": "_get_cudnn_sdp_enabled",
    "math": "_get_math_sdp_enabled",
    "overrideable": "_get_overrideable_sdp_enabled",
}
_SETTERS = {
    "flash": "_set_sdp_use_flash",
    "efficient": "_set_sdp_use_mem_efficient",
    "cudnn": "_set_sdp_use_cudnn",
    "math": "_set_sdp_use_math",
    "overrideable": "_set_sdp_use_overrideable",
}
# torch.nn.attention.SDPBackend values, as the priority order stores them
_CODES = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3, "overrideable": 4}
_NAMES = {code: name for name, code in _CODES.items()}
_SDPBACKEND_NAMES = {
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "MATH": "math",
}

# Feature detection: cuDNN attention, overrideable and the priority order arrived over 2.2-2.5
PRESENT = tuple(n for n in _ALL if hasattr(_C, _GETTERS[n]) and hasattr(_C, _SETTERS[n]))
HAS_PRIORITY = hasattr(_C, "_get_sdp_priority_order") and hasattr(_C, "_set_sdp_priority_order")
# The getters resolved once (None where absent): read() runs twice per frame, and once per call
# of a compiled step (speedflags._compile.lever_state).
_READERS = tuple(getattr(_C, _GETTERS[n]) if n in PRESENT else None for n in _ALL)
_read_order: Any = _C._get_sdp_priority_order if HAS_PRIORITY else None

# PyTorch's one write of its own (pytorch/pytorch#185511): on compute capability 9.x/10.x
# with cuDNN newer than 9.15, the first CUDA SDPA call of a process writes its cuDNN-first
# default over the first four places of the priority order, whatever was there
# (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``priority_order``).
_TORCH_FIRST_CALL_ORDER = tuple(_CODES[n] for n in ("cudnn", "flash", "efficient", "math"))
_torch_write_pending = HAS_PRIORITY


def _settle_torch_first_call() -> None:
    """Have PyTorch make that write now, before a frame reads the state it will restore.

    Made inside a block, it would override the block's preference from its first SDPA call
    on, and the block's exit, restoring the order it found, would take PyTorch's cuDNN-first
    default from the rest of the process. ``torch._fused_sdp_choice`` runs the kernel
    selection, which makes the write, without running attention. Only once CUDA is
    initialised: no CUDA SDPA call can have run before, and speedflags never initialises
    CUDA itself.
    """
    global _torch_write_pending
    if not torch.cuda.is_available():
        _torch_write_pending = False
        return
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call, unused-ignore]
        return
    # nothing is allocated while a CUDA graph is being captured: the next frame will do it
    if torch.cuda.is_current_stream_capturing():  # type: ignore[no-untyped-call, unused-ignore]
        return
    _torch_write_pending = False
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        return
    q = torch.empty(1, 1, 8, 64, device="cuda", dtype=torch.float16)  # metadata only
    try:
        torch._fused_sdp_choice(q, q, q)
    except RuntimeError:  # every kernel disabled: the selection (and the write) ran all the same
        pass


def settle_first_call() -> None:
    """PyTorch's pending first-call write of the SDPA priority order, made now (where it is
    pending and CUDA is in use): for a tool that compares the state before and after its own
    work (``verify``), so that PyTorch's one write is not taken for a lever left changed.

    Example:
        >>> from speedflags.levers.sdpa import settle_first_call
        >>> settle_first_call()  # nothing to do without a GPU in use
    """
    if _torch_write_pending:
        _settle_torch_first_call()


SdpaState = tuple[tuple[bool | None, ...], tuple[int, ...] | None]


class SdpaLever(SimpleLever):
    """``sdpa="flash"`` or ``sdpa=("flash", "efficient")``: an ordered kernel preference.

    Scope: process (PyTorch's SDPA flags are C++ globals, not thread-local). Restores every
    backend's enabled flag and the exact priority order.
    """

    name = "sdpa"
    scope = "process"
    domain = "sdpa"

    @staticmethod
    def validate(value: object) -> tuple[str, ...]:
        choices = ", ".join(repr(b) for b in BACKENDS)
        items: Sequence[object]
        if isinstance(value, (str, bytes)) or _is_sdpbackend(value):
            items = (value,)
        elif isinstance(value, (list, tuple)):
            items = value
        else:
            raise InvalidTypeError(
                f"expected a backend name or a sequence of them "
                f"({choices}), got {type(value).__name__}"
            )
        if not items:
            raise InvalidValueError(f"name at least one backend of {choices}")
        names = []
        for item in items:
            if _is_sdpbackend(item):
                name = _SDPBACKEND_NAMES.get(getattr(item, "name", ""), "")
            elif isinstance(item, str):
                name = item
            else:
                raise InvalidTypeError(
                    f"{short_repr(item)} is not a backend name; valid: {choices}"
                )
            if name not in BACKENDS:
                raise InvalidValueError(f"unknown backend {short_repr(item)}; valid: {choices}")
            if name in names:
                raise InvalidValueError(f"backend {name!r} is listed twice")
            names.append(name)
        return tuple(names)

    def frame_read(self) -> SdpaState:
        """:meth:`read`, for a frame about to set the lever: PyTorch's pending first-call
        write is made first (once CUDA is in use), so the frame finds and restores the order
        PyTorch would keep. Only frames do this: reading the state never writes it."""
        if _torch_write_pending:
            _settle_torch_first_call()
        return self.read()

    def read(self) -> SdpaState:
        flags = tuple([None if get is None else bool(get()) for get in _READERS])
        return flags, (None if _read_order is None else tuple(_read_order()))

    def apply(self, value: tuple[str, ...], before: SdpaState) -> SdpaState:
        allowed = set(value) | {"math"}
        flags = tuple(
            (name in allowed if name in BACKENDS else old) if old is not None else None
            for name, old in zip(_ALL, before[0], strict=True)
        )
        order = before[1]
        if order is not None:
            head = [_CODES[n] for n in value] + ([] if "math" in value else [_CODES["math"]])
            order = tuple(head + [code for code in order if code not in head])
        target: SdpaState = (flags, order)
        self._write(target, before)
        after: SdpaState = verified(self, "setting", target, self.read())
        return after

    def restore(self, target: SdpaState, current: SdpaState) -> SdpaState:
        self._write(target, current)
        after: SdpaState = verified(self, "restoring", target, self.read())
        return after

    @staticmethod
    def _write(target: SdpaState, current: SdpaState) -> None:
        for name, want, have in zip(_ALL, target[0], current[0], strict=True):
            if want is not None and want != have:
                getattr(_C, _SETTERS[name])(want)
        if target[1] is not None and target[1] != current[1]:
            _C._set_sdp_priority_order(list(target[1]))

    def torch_write(self, before: SdpaState, after: SdpaState) -> str | None:
        """``before`` -> ``after`` in words if it is the change PyTorch makes by itself, in
        C++ where no watch sees it: on compute capability 9.x/10.x with cuDNN > 9.15, the
        first SDPA call in a process writes cuDNN, flash, efficient, math over the first four
        places of the priority order (pytorch/pytorch#185511). Otherwise None. (Usually made
        before any block: see ``_settle_torch_first_call``.)"""
        old, new = before[1], after[1]
        if before[0] != after[0] or old is None or new is None or old == new:
            return None
        width = len(_TORCH_FIRST_CALL_ORDER)
        if new[:width] != _TORCH_FIRST_CALL_ORDER or new[width:] != old[width:]:
            return None
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
            return None
        return (
            "PyTorch's first SDPA call on this GPU wrote its cuDNN-first default priority "
            "order (pytorch/pytorch#185511)"
        )

    def describe(self, state: SdpaState) -> Any:
        flags, order = state
        out: dict[str, Any] = {
            name: flag for name, flag in zip(_ALL, flags, strict=True) if flag is not None
        }
        out["priority"] = (
            [_NAMES.get(code, str(code)) for code in order] if order is not None else None
        )
        return out

    def describe_value(self, value: tuple[str, ...]) -> Any:
        return list(value)

    def available(self, value: tuple[str, ...], device: torch.device) -> Effect:
        caps = capabilities(device)
        support = {
            "flash": caps.flash_sdpa,
            "efficient": caps.efficient_sdpa,
            "cudnn": caps.cudnn_sdpa,
            "math": None,
        }
        notes = []
        missing = [n for n in value if n not in PRESENT]
        if missing:
            notes.append(
                f"PyTorch {torch.__version__} has no {', '.join(missing)} SDPA backend; "
                "nothing written for it"
            )
        if not HAS_PRIORITY:
            notes.append(
                f"PyTorch {torch.__version__} has no SDPA priority order: the order of the "
                "preference is not applied, only which backends are enabled"
            )
        first = value[0]
        cap = support[first]
        if first in missing or (cap is not None and not cap.supported):
            why = cap.reason if cap is not None and not cap.supported else "not in this PyTorch"
            notes.insert(0, f"the preferred {first!r} kernel cannot run on {caps.device} ({why})")
            return Effect(False, "; ".join(notes))
        return Effect(True, "; ".join(notes))


def _is_sdpbackend(value: object) -> bool:
    return type(value).__name__ in ("SDPBackend", "_SDPBackend") and hasattr(value, "name")


SDPA_BACKEND_SHORTHAND = Shorthand(
    name="sdpa_backend",
    parameter="backends",
    default=UNSET,
    variadic=True,
    doc="""Preferred SDPA kernels, in order: ``fast_math(sdpa=backends)``.

    The math kernel stays enabled as the fallback, so inputs the preferred kernels cannot
    take still run. Scope: process. Restores every backend flag and the priority order.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.sdpa_backend("math"):
        ...     torch.backends.cuda.flash_sdp_enabled()
        False
    """,
)


_BACKEND_CHOICES = ", ".join(repr(b) for b in BACKENDS)
DECLARED = (
    declare(
        SdpaLever(),
        shorthand=SDPA_BACKEND_SHORTHAND,
        order=40,
        values=f"a backend ({_BACKEND_CHOICES}) or an ordered sequence of them",
        summary="preferred scaled_dot_product_attention kernels (math kept as the fallback)",
        accuracy="kernel-dependent, usually within fp16/bf16 rounding of the math kernel",
        candidates=tuple((b,) for b in BACKENDS if b != "math"),
        ops=("scaled_dot_product",),
        dynamo_misses="all of it: the enabled kernels and their priority order",
    ),
)
