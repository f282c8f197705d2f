"""The levers a bare ``fast_math()`` (and a bare ``@speedup``) applies, per device.

- NVIDIA GPU, Ampere (sm80) or newer: ``tf32=True, amp="bf16"``. TF32 tensor cores for the
  float32 work autocast leaves, native bf16 for the rest.
- NVIDIA GPU, Volta/Turing (sm70-sm75): ``amp="fp16"``. fp16 tensor cores; no TF32 and no
  native bf16 (train with a GradScaler).
- CPU with AVX512-BF16 or AMX, where the installed PyTorch runs bf16 matmuls on it (tried
  once: ``capabilities("cpu").bf16``): ``amp="bf16"``. Native bf16 dot products. On a Zen 4
  CPU, which runs bf16 at twice its fp32 rate, autocast measured 2.0-2.3x on a 2048^3 matmul
  with 1 thread and 2.1-2.7x with 2 (``docs/performance.md``); AMX runs them on tiles, faster
  still.
- Anything else: nothing. No lever is faster there; the frame records why.

``cudnn_benchmark`` is never recommended by default: it re-tunes for every new input shape,
which is a win only for convolutional models with fixed shapes. ``sdpa`` is left to
PyTorch's own dispatcher, which already picks the fastest kernel an input allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._hardware import DeviceLike, capabilities, resolve_device
from ._short_repr import set_module

__all__ = ["Recommendation", "recommended"]


@set_module("speedflags")
@dataclass(frozen=True)
class Recommendation:
    """The recommended levers for one device, each with the reason it is (or is not) there.

    Attributes:
        device: the device this is for.
        levers: ``fast_math`` arguments, e.g. ``{"tf32": True, "amp": "bf16"}``.
        reasons: lever name -> why it is in (or why nothing is recommended: key ``"*"``).

    Example:
        >>> import speedflags
        >>> rec = speedflags.recommended("cpu")
        >>> rec.device, set(rec.levers) <= {"amp"}, all(rec.reasons.values())
        ('cpu', True, True)
    """

    device: str
    levers: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


def recommended(device: DeviceLike = None) -> Recommendation:
    """The levers a bare ``fast_math()`` applies on ``device`` (default: CUDA if available).

    Example:
        >>> import speedflags
        >>> rec = speedflags.recommended("cpu")
        >>> rec.levers in ({"amp": "bf16"}, {})
        True
    """
    target = resolve_device(device, "recommended")
    caps = capabilities(target)
    levers: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    if target.type == "cuda":
        if caps.tf32:
            levers["tf32"] = True
            reasons["tf32"] = (
                f"{caps.tf32.reason}: float32 matmuls and convolutions on TF32 tensor cores"
            )
        if caps.bf16:
            levers["amp"] = "bf16"
            reasons["amp"] = f"{caps.bf16.reason}: bf16 autocast, no loss scaling needed"
        elif (
            caps.fp16 and caps.compute_capability is not None and caps.compute_capability >= (7, 0)
        ):
            levers["amp"] = "fp16"
            reasons["amp"] = f"{caps.fp16.reason}: fp16 autocast (train with a GradScaler)"
        if not levers:
            reasons["*"] = f"no lever is faster on {caps.device}: {caps.fp16.reason}"
    else:
        if caps.bf16:
            levers["amp"] = "bf16"
            reasons["amp"] = f"{caps.bf16.reason}: bf16 autocast runs on native instructions"
        else:
            reasons["*"] = f"no lever is faster on {caps.device}: {caps.bf16.reason}"
    return Recommendation(caps.device, levers, reasons)
