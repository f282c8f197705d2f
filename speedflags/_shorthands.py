"""The single-lever shorthands: ``tf32()``, ``matmul_precision()``, ``cudnn_benchmark()``,
``sdpa_backend()``, ``deterministic()``, ``reduced_precision_reduction()`` and ``autocast()``,
each a :class:`~speedflags.FastMath` for one lever with a label that names the call.
Called inside a function given to ``torch.compile``, each returns what ``fast_math`` returns
there (``speedflags._fast_math.in_graph``): ``autocast()`` a ``torch.autocast``.
"""

from __future__ import annotations

import enum
from typing import Any

from ._fast_math import FastMath
from ._fast_math.in_graph import built_in_graph
from ._hardware import DeviceLike, normalize_device
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
def tf32(enabled: bool = True, *, strict: bool = False) -> FastMath:
    """TF32 on (or off) for cuBLAS matmuls and cuDNN conv/rnn: ``fast_math(tf32=enabled)``.

    Scope: process. Restores every getter of both TF32 API families.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.tf32():
        ...     torch.backends.cuda.matmul.allow_tf32
        True
    """
    value = lever_spec("tf32").check("tf32", enabled, "enabled")
    return FastMath(tf32=value, strict=strict, label=f"tf32({value!r})")


@built_in_graph
def matmul_precision(value: MatmulPrecisionArg, *, strict: bool = False) -> FastMath:
    """Float32 matmul precision for a block: ``fast_math(matmul_precision=value)``.

    Scope: process. Restores the legacy precision and the cuBLAS and oneDNN matmul nodes.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.matmul_precision("high"):
        ...     torch.get_float32_matmul_precision()
        'high'
    """
    checked = lever_spec("matmul_precision").check("matmul_precision", value, "value")
    return FastMath(matmul_precision=checked, strict=strict, label=f"matmul_precision({checked!r})")


@built_in_graph
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
    value = lever_spec("cudnn_benchmark").check("cudnn_benchmark", enabled, "enabled")
    return FastMath(cudnn_benchmark=value, strict=strict, label=f"cudnn_benchmark({value!r})")


@built_in_graph
def sdpa_backend(*backends: SdpaName | enum.Enum, strict: bool = False) -> FastMath:
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
    return FastMath(sdpa=value, strict=strict, label=f"sdpa_backend({shown})")


@built_in_graph
def deterministic(mode: DeterministicArg = True, *, strict: bool = False) -> FastMath:
    """Deterministic algorithms for a block: ``fast_math(deterministic=mode)``.

    ``True``: ``torch.use_deterministic_algorithms(True)`` (an operation with no deterministic
    implementation raises) and ``torch.backends.cudnn.deterministic = True``; ``"warn"``: the
    same in warn-only mode (it warns instead); ``False``: all of it off. Often slower, never
    faster. Refused together with ``cudnn_benchmark=True`` in one spec.

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
    return FastMath(deterministic=value, strict=strict, label=f"deterministic({value!r})")


@built_in_graph
def reduced_precision_reduction(enabled: bool = True, *, strict: bool = False) -> FastMath:
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
        strict=strict,
        label=f"reduced_precision_reduction({value!r})",
    )


@built_in_graph
def autocast(dtype: AmpArg, device: DeviceLike = None, *, strict: bool = False) -> FastMath:
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
        amp=dtype, device=device, strict=strict, label=f"autocast({dtype!r}{label_device})"
    )
