"""The single-lever shorthands: ``tf32()``, ``matmul_precision()``, ``cudnn_benchmark()``,
``sdpa_backend()``, ``deterministic()``, ``reduced_precision_reduction()`` and ``autocast()``,
each a :class:`~speedflags.FastMath` for one lever with a label that names the call. Each
takes ``fast_math``'s ``device=``, ``strict=`` and ``label=`` keywords, with their meaning.
Called inside a function given to ``torch.compile``, each returns what ``fast_math`` returns
there (``speedflags._fast_math.in_graph``): ``autocast()`` a ``torch.autocast``.
"""

from __future__ import annotations

import enum
from typing import Any

from ._fast_math import FastMath
from ._fast_math.in_graph import built_in_graph
from ._hardware import DeviceLike, normalize_device
from ._short_repr import short_repr, type_name
from .errors import InvalidTypeError
from .levers.arguments import AmpArg, DeterministicArg, MatmulPrecisionArg, SdpaName
from .levers.registry import lever_spec

__all__ = [
    "autocast",
    "cudnn_benchmark",
    "deterministic",
    "matmul_precision",
    "reduced_precision_reduction",
    "sdpa_backend",
    "tf32",
]


@built_in_graph
def tf32(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
    """TF32 on (or off) for cuBLAS matmuls and cuDNN conv/rnn: ``fast_math(tf32=enabled)``.

    Scope: process. Restores every getter of both TF32 API families.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.tf32():
        ...     torch.backends.cuda.matmul.allow_tf32
        True
    """
    value = lever_spec("tf32").check("tf32", enabled, "enabled")
    return FastMath(
        tf32=value,
        device=device,
        strict=strict,
        label=_label("tf32", label, device, f"tf32({value!r})"),
    )


@built_in_graph
def matmul_precision(
    value: MatmulPrecisionArg,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
    """Float32 matmul precision for a block: ``fast_math(matmul_precision=value)``.

    Scope: process. Restores the legacy precision and the cuBLAS and oneDNN matmul nodes.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.matmul_precision("high"):
        ...     torch.get_float32_matmul_precision()
        'high'
    """
    checked = lever_spec("matmul_precision").check("matmul_precision", value, "value")
    shown = f"matmul_precision({checked!r})"
    return FastMath(
        matmul_precision=checked,
        device=device,
        strict=strict,
        label=_label("matmul_precision", label, device, shown),
    )


@built_in_graph
def cudnn_benchmark(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
    """``torch.backends.cudnn.benchmark`` for a block, and nothing else.

    Scope: process. Restores the previous ``benchmark`` value; ``enabled``,
    ``deterministic`` and TF32 are never touched.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.cudnn_benchmark():
        ...     torch.backends.cudnn.benchmark
        True
    """
    value = lever_spec("cudnn_benchmark").check("cudnn_benchmark", enabled, "enabled")
    shown = f"cudnn_benchmark({value!r})"
    return FastMath(
        cudnn_benchmark=value,
        device=device,
        strict=strict,
        label=_label("cudnn_benchmark", label, device, shown),
    )


@built_in_graph
def sdpa_backend(
    *backends: SdpaName | enum.Enum,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
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
    value = lever_spec("sdpa").check("sdpa_backend", given, "backends")
    return FastMath(
        sdpa=value,
        device=device,
        strict=strict,
        label=_label("sdpa_backend", label, device, f"sdpa_backend({shown})"),
    )


@built_in_graph
def deterministic(
    mode: DeterministicArg = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
    """Deterministic algorithms for a block: ``fast_math(deterministic=mode)``.

    ``True``: ``torch.use_deterministic_algorithms(True)`` (an operation with no deterministic
    implementation raises) and ``torch.backends.cudnn.deterministic = True``; ``"warn"``: the
    same in warn-only mode (it warns instead); ``False``: all of it off. Often slower, never
    faster. Refused together with ``cudnn_benchmark=True``: in one spec, and entered while
    ``torch.backends.cudnn.benchmark`` is on (inside a ``cudnn_benchmark=True`` block), as
    ``cudnn_benchmark=True`` is while deterministic algorithms are on.

    Scope: process. Restores the deterministic mode, its warn-only flag and
    ``cudnn.deterministic`` exactly as found.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.deterministic("warn"):
        ...     torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
        (True, True)
        >>> torch.are_deterministic_algorithms_enabled()
        False
    """
    value = lever_spec("deterministic").check("deterministic", mode, "mode")
    shown = f"deterministic({value!r})"
    return FastMath(
        deterministic=value,
        device=device,
        strict=strict,
        label=_label("deterministic", label, device, shown),
    )


@built_in_graph
def reduced_precision_reduction(
    enabled: bool = True,
    *,
    device: DeviceLike = None,
    strict: bool = False,
    label: str | None = None,
) -> FastMath:
    """cuBLAS reductions of fp16/bf16 GEMMs in reduced precision (``True``, PyTorch's default)
    or in fp32 (``False``): ``fast_math(reduced_precision_reduction=enabled)``.

    Writes ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`` and
    ``allow_bf16_reduced_precision_reduction``; ``False`` also turns
    ``allow_fp16_accumulation`` off where PyTorch has it. No effect on a CPU.

    Scope: process. Restores both flags (with their split-K part where PyTorch has one) and
    ``allow_fp16_accumulation`` exactly as found.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.reduced_precision_reduction(False):
        ...     torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        False
        >>> torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        True
    """
    value = lever_spec("reduced_precision_reduction").check(
        "reduced_precision_reduction", enabled, "enabled"
    )
    return FastMath(
        reduced_precision_reduction=value,
        device=device,
        strict=strict,
        label=_label(
            "reduced_precision_reduction", label, device, f"reduced_precision_reduction({value!r})"
        ),
    )


@built_in_graph
def autocast(
    dtype: AmpArg, device: DeviceLike = None, *, strict: bool = False, label: str | None = None
) -> FastMath:
    """Autocast in ``dtype`` on ``device`` for a block: ``fast_math(amp=dtype, device=device)``.

    Scope: thread (like ``torch.autocast``). Restores the thread's autocast flag and dtype.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.autocast("bf16", device="cpu"):
        ...     speedflags.snapshot()["amp"]["cpu"], (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        ({'enabled': True, 'dtype': 'bfloat16'}, torch.bfloat16)
    """
    lever_spec("amp").check("autocast", dtype, "dtype")
    label_device = (
        f", device={str(normalize_device(device, 'autocast'))!r}" if device is not None else ""
    )
    return FastMath(
        amp=dtype,
        device=device,
        strict=strict,
        label=_label("autocast", label, device, f"autocast({dtype!r}{label_device})"),
    )


def _label(name: str, given: object, device: DeviceLike, shown: str) -> str:
    # the caller's label, else one naming the call; both keywords checked with the
    # shorthand's name in the message (FastMath checks them again, as fast_math's)
    normalize_device(device, name)
    if given is None:
        return shown
    if not isinstance(given, str):
        raise InvalidTypeError(
            f"{name}(label={short_repr(given)}): expected a str, got {type_name(given)}"
        )
    return given
