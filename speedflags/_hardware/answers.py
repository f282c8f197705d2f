"""The shape of an answer about a device: :class:`Capability` and :class:`Capabilities`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .._short_repr import set_module

__all__ = ["Capabilities", "Capability"]


@set_module("speedflags")
@dataclass(frozen=True)
class Capability:
    """One yes/no answer about a device, with the reason.

    ``bool(capability)`` is ``supported``. ``missing_kernel`` is True where the hardware has
    the instructions but the installed PyTorch does not run the operation on this device
    (trying it raised): a lever that needs it is refused, not merely slow.

    Example:
        >>> from speedflags import capabilities
        >>> cap = capabilities("cpu").tf32
        >>> bool(cap), cap.reason
        (False, 'TF32 is a tensor-core mode of NVIDIA Ampere (sm80) and newer GPUs; a CPU has none')
    """

    supported: bool
    reason: str
    missing_kernel: bool = False

    def __bool__(self) -> bool:
        return self.supported


@set_module("speedflags")
@dataclass(frozen=True)
class Capabilities:
    """What one device can do (see :func:`~speedflags._hardware.capabilities`).

    Attributes:
        device: the device these answers are about (``"cuda:0"``, ``"cpu"``).
        name: the GPU's name, or the CPU's model name.
        compute_capability: ``(major, minor)`` for a CUDA device, else ``None``.
        tf32: TF32 tensor-core matmuls and convolutions.
        bf16: *native* bfloat16 arithmetic (not emulated; ``torch.cuda.is_bf16_supported()``
            says True on a T4 because it counts emulation). On a CPU: the instructions
            (AVX512-BF16, AMX-BF16, Arm BF16) *and* the installed PyTorch running bfloat16
            matmuls and their backward on the CPU, found by trying them.
        fp16: fast float16 arithmetic. On a CPU: AMX-FP16 or AVX512-FP16 *and* the
            installed PyTorch running float16 matmuls and their backward on the CPU
            (PyTorch 2.1 has no CPU float16 matmul).
        flash_sdpa, efficient_sdpa, cudnn_sdpa: which fused attention kernels can run.
        fp8: FP8 tensor cores that run PyTorch's scaled float8 matmul (NVIDIA sm89 and
            newer: Ada, Hopper, Blackwell); what the ``fp8`` lever needs to run natively.
        cpu_bf16: bf16 on the host CPU, as ``bf16`` answers it for a CPU (the same answer).

    Example:
        >>> import speedflags
        >>> caps = speedflags.capabilities("cpu")
        >>> caps.device, bool(caps.tf32), caps.bf16 == caps.cpu_bf16
        ('cpu', False, True)
    """

    device: str
    name: str
    compute_capability: tuple[int, int] | None
    tf32: Capability
    bf16: Capability
    fp16: Capability
    flash_sdpa: Capability
    efficient_sdpa: Capability
    cudnn_sdpa: Capability
    fp8: Capability
    cpu_bf16: Capability

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of every answer."""
        return asdict(self)
