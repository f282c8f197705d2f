"""What the probes measure with: inputs, the error of a result, and what really ran.

- :func:`arithmetic` names the arithmetic a relative error against float64 reveals: fp32
  (about 1e-7), TF32 or fp16 (about 3e-4: inputs rounded to 10 mantissa bits) or bf16 (about
  3e-3: 7 bits). The levels are two orders of magnitude apart, so one small matmul tells them
  apart; see ``docs/performance.md`` ("Accuracy").
- :func:`aten_ops` records the ATen operators a call dispatched (a ``TorchDispatchMode``), so
  a probe sees which SDPA kernel ran, not which one was asked for.
- :func:`cuda_trace` records, with ``torch.profiler``, the CPU-side operators and the names of
  the CUDA kernels a call launched (CUDA only: the profiler's CUDA activity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .accuracy import relative_error

__all__ = [
    "FP32_MAX",
    "TF32_MAX",
    "Observation",
    "Trace",
    "arithmetic",
    "aten_ops",
    "aten_outputs",
    "cuda_trace",
    "inputs",
    "relative_error",
]

SEED = 20261123
# Relative-error levels (see the module docstring): fp32 stays under FP32_MAX, TF32 and fp16
# inputs under TF32_MAX, bf16 above it. Measured fp32: 1.5e-7 to 6e-7 (CPU); TF32 and fp16:
# about 2.9e-4; bf16: 2.3e-3 to 2.9e-3.
FP32_MAX = 2e-5
TF32_MAX = 1.2e-3


def arithmetic(error: float, half: str = "tf32") -> str:
    """The arithmetic a relative error against float64 shows: ``"fp32"``, ``half`` or ``"bf16"``.

    ``half`` names the middle level: ``"tf32"`` for a float32 matmul, ``"fp16"`` under fp16
    autocast (both round to 10 mantissa bits).

    Example:
        >>> from speedflags._measure.evidence import arithmetic
        >>> arithmetic(2.5e-7), arithmetic(2.9e-4), arithmetic(2.9e-3), arithmetic(3e-4, "fp16")
        ('fp32', 'tf32', 'bf16', 'fp16')
    """
    if error < FP32_MAX:
        return "fp32"
    return half if error < TF32_MAX else "bf16"


def inputs(
    shapes: Sequence[tuple[int, ...]], device: torch.device, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Random normal tensors from a private generator (the process's RNG is left alone).

    Example:
        >>> import torch
        >>> from speedflags._measure.evidence import inputs
        >>> a, b = inputs([(2, 3), (3,)], torch.device("cpu"))
        >>> a.shape, b.dtype
        (torch.Size([2, 3]), torch.float32)
    """
    gen = torch.Generator(device=device).manual_seed(SEED)
    return [torch.randn(*shape, generator=gen, device=device).to(dtype) for shape in shapes]


Call = tuple[str, tuple[tuple[torch.dtype, tuple[int, ...]], ...]]


def aten_calls(fn: Callable[[], Any]) -> tuple[Any, list[Call]]:
    """Run ``fn()``; return its result and each ATen call it dispatched, in order: the
    operator's base name and each tensor argument's ``(dtype, strides)``.

    Example:
        >>> import torch
        >>> from speedflags._measure.evidence import aten_calls
        >>> out, calls = aten_calls(lambda: torch.ones(2, 3) @ torch.ones(3, 2))
        >>> calls[-1]
        ('mm', ((torch.float32, (3, 1)), (torch.float32, (2, 1))))
    """
    import torch.utils._python_dispatch as dispatch

    mode_class: Any = dispatch.TorchDispatchMode  # untyped in torch's stubs
    calls: list[Call] = []

    class Recorder(mode_class):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
        ) -> Any:
            tensors = tuple(
                (a.dtype, tuple(a.stride())) for a in args if isinstance(a, torch.Tensor)
            )
            calls.append((str(getattr(func, "__name__", func)).split(".")[0], tensors))
            return func(*args, **(kwargs or {}))

    with Recorder():
        out = fn()
    return out, calls


def aten_outputs(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, torch.dtype]]]:
    """Run ``fn()``; return its result and, for each ATen call it dispatched that returned a
    tensor, the operator's base name and that tensor's dtype (what a cast made: a call inside
    a tensor subclass's own dispatch is not seen, its result is).

    Example:
        >>> import torch
        >>> from speedflags._measure.evidence import aten_outputs
        >>> out, made = aten_outputs(lambda: torch.ones(2).to(torch.bfloat16))
        >>> made[-1]
        ('_to_copy', torch.bfloat16)
    """
    import torch.utils._python_dispatch as dispatch

    mode_class: Any = dispatch.TorchDispatchMode  # untyped in torch's stubs
    made: list[tuple[str, torch.dtype]] = []

    class Recorder(mode_class):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
        ) -> Any:
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor):
                made.append((str(getattr(func, "__name__", func)).split(".")[0], result.dtype))
            return result

    with Recorder():
        out = fn()
    return out, made


def aten_ops(fn: Callable[[], Any]) -> tuple[Any, frozenset[str]]:
    """Run ``fn()``; return its result and the ATen operators it dispatched (``"mm"``, ...).

    Names are the operators' base names without namespace and overload
    (``aten._scaled_dot_product_flash_attention_for_cpu.default`` ->
    ``"_scaled_dot_product_flash_attention_for_cpu"``). Composite operators appear through
    what they decompose into.

    Example:
        >>> import torch
        >>> from speedflags._measure.evidence import aten_ops
        >>> out, ops = aten_ops(lambda: torch.ones(2, 2) @ torch.ones(2, 2))
        >>> "mm" in ops
        True
    """
    import torch.utils._python_dispatch as dispatch

    mode_class: Any = dispatch.TorchDispatchMode  # untyped in torch's stubs
    seen: set[str] = set()

    class Recorder(mode_class):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
        ) -> Any:
            seen.add(str(getattr(func, "__name__", func)).split(".")[0])
            return func(*args, **(kwargs or {}))

    with Recorder():
        out = fn()
    return out, frozenset(seen)


@dataclass(frozen=True)
class Trace:
    """What ``torch.profiler`` saw of one call on a CUDA device.

    Attributes:
        ops: the names of the CPU-side events (``"aten::mm"``, ``"cudaGraphLaunch"``).
        kernels: the CUDA kernels launched, in order, repeats included.
        kernel_s: the kernels' summed run time on the device, in seconds (how long the
            GPU was busy; the call's wall time minus it is what the GPU waited).
    """

    ops: frozenset[str]
    kernels: tuple[str, ...]
    kernel_s: float = 0.0

    def distinct_kernels(self) -> tuple[str, ...]:
        """The kernel names without repeats, in order of first launch."""
        return tuple(dict.fromkeys(self.kernels))


def cuda_trace(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Trace]:
    """Run ``fn()`` under ``torch.profiler`` with CUDA activity; return its result and trace.

    The device is synchronised before the profiler stops, so every kernel the call launched
    is in the trace. Needs a CUDA build with a GPU; on a CPU the caller never gets here.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        out = fn()
        torch.cuda.synchronize(device)
    ops: set[str] = set()
    kernels: list[str] = []
    busy_us = 0.0
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            kernels.append(str(event.name))
            span = getattr(event, "time_range", None)
            if span is not None:
                busy_us += max(0.0, float(span.end) - float(span.start))
        else:
            ops.add(str(event.name))
    return out, Trace(frozenset(ops), tuple(kernels), busy_us * 1e-6)


def short(name: str, width: int = 60) -> str:
    """A kernel name cut to ``width`` characters (C++ template names run to kilobytes).

    Example:
        >>> from speedflags._measure.evidence import short
        >>> short("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 36)
        'void pytorch_flash::flash_fwd_ker...'
    """
    return name if len(name) <= width else name[: width - 3] + "..."


@dataclass(frozen=True)
class Observation:
    """What one probe measured.

    Attributes:
        in_effect: the measurement shows the lever working.
        figure: the measurement in words.
        measured: the numbers behind it.
        inside: what the flags read inside the frame (``tf32_status``, cuDNN and oneDNN
            switches), for finding a cause.
        unused: for a lever that only *allows* something (``reduced_precision_reduction``):
            why the device's library did not take the permission though the flags read as
            asked. Set, a measurement without effect is "no effect here", not a failure.
    """

    in_effect: bool
    figure: str
    measured: dict[str, Any] = field(default_factory=dict)
    inside: dict[str, Any] = field(default_factory=dict)
    unused: str = ""
