"""What a device can do, each answer with the reason behind it.

Answers are computed once per device and cached: hardware does not change while a process
runs. Nothing here writes torch state. Asking about a CUDA device initialises CUDA, as any
``torch.cuda.get_device_capability`` call does. A CPU's bf16 and fp16 answers are the
instructions *and* what the installed PyTorch runs, found by trying (:mod:`.cpu`).

Modules: :mod:`.answers` (``Capability``, ``Capabilities``), :mod:`.cpu` (the host CPU's
instructions and the dtype trials); the CUDA answers and ``capabilities()`` are here.

What this subpackage may import: torch and speedflags' base modules (``errors``,
``_short_repr``); nothing above them.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch._C as torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

from .._locks import new_lock
from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError
from .answers import Capabilities, Capability
from .cpu import CpuFeatures, KernelTrial, cpu_dtype, cpu_features, cpu_kernels

__all__ = [
    "Capabilities",
    "Capability",
    "CpuFeatures",
    "KernelTrial",
    "capabilities",
    "cpu_dtype",
    "cpu_features",
    "cpu_kernels",
    "default_device",
    "resolve_device",
]

DeviceLike = str | torch.device | None


def normalize_device(value: DeviceLike, call: str = "device") -> torch.device | None:
    """Validate a ``device=`` argument without touching any device state.

    Errors read ``"{call}(device='gpu'): not a device PyTorch knows; ..."``.
    """
    if value is None:
        return None
    shown = f"{call}(device={short_repr(value)})"
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:
            raise InvalidValueError(
                f"{shown}: not a device PyTorch knows; use 'cpu', 'cuda' or 'cuda:N'"
            ) from None
    else:
        raise InvalidTypeError(
            f"{shown}: expected a str or torch.device such as 'cpu' or 'cuda', "
            f"got {type(value).__name__}"
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidValueError(f"{shown}: speedflags supports the device types 'cpu' and 'cuda'")
    return device


_default: torch.device | None = None


def default_device() -> torch.device:
    """``cuda`` when a CUDA device is available, else ``cpu`` (asked once per process)."""
    global _default
    if _default is None:
        _default = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return _default


def resolve_device(device: DeviceLike, call: str = "device") -> torch.device:
    """The device a ``device=None`` (or string) argument stands for."""
    normalized = normalize_device(device, call)
    return default_device() if normalized is None else normalized


def missing_cuda(device: torch.device) -> str | None:
    """Why ``device`` cannot be used here (no CUDA, or no GPU of that index), or None.

    Example:
        >>> import torch
        >>> from speedflags._hardware import missing_cuda
        >>> missing_cuda(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:  # index None: the current device, which exists
        return f"this machine has {count} CUDA device{'s' if count != 1 else ''} (cuda:0 and up)"
    return None


_cache: dict[str, Capabilities] = {}
_cache_lock = new_lock()


def capabilities(device: DeviceLike = None) -> Capabilities:
    """What ``device`` (default: CUDA if available, else CPU) can do, each with a reason.

    Results are cached per device: hardware does not change while a process runs.

    Example:
        >>> from speedflags import capabilities
        >>> caps = capabilities("cpu")
        >>> caps.device, caps.tf32.supported
        ('cpu', False)
    """
    target = resolve_device(device, "capabilities")
    index: int | None = target.index
    if target.type == "cuda" and index is None and torch.cuda.is_available():
        target = torch.device("cuda", torch.cuda.current_device())
    key = str(target)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    caps = _cuda_capabilities(target) if target.type == "cuda" else _cpu_capabilities()
    with _cache_lock:
        _cache[key] = caps
    return caps


def _clear_cache() -> None:
    # Tests that fake a GPU (compute capability) must not see answers cached for the real one.
    global _default
    with _cache_lock:
        _cache.clear()
        _default = None


# --- CPU -----------------------------------------------------------------------------------


def _host_cpu_bf16() -> Capability:
    return cpu_dtype(torch.bfloat16)


def _cpu_capabilities() -> Capabilities:
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    cpu_bf16 = _host_cpu_bf16()
    no_fused = "fused kernel for CUDA GPUs only; CPU attention uses the flash (CPU) or math kernel"
    return Capabilities(
        device="cpu",
        name=cpu_features().name or f"CPU ({capability or 'unknown ISA'})",
        compute_capability=None,
        tf32=Capability(
            False,
            "TF32 is a tensor-core mode of NVIDIA Ampere (sm80) and newer GPUs; a CPU has none",
        ),
        bf16=cpu_bf16,
        fp16=cpu_dtype(torch.float16),
        # PyTorch 2.1 runs it too (aten::_scaled_dot_product_flash_attention on CPU tensors);
        # 2.2 renamed the CPU operator _scaled_dot_product_flash_attention_for_cpu
        flash_sdpa=Capability(True, "PyTorch's CPU flash-attention kernel runs on any CPU"),
        efficient_sdpa=Capability(False, f"memory-efficient attention is a {no_fused}"),
        cudnn_sdpa=Capability(False, f"cuDNN attention is a {no_fused}"),
        fp8=Capability(False, f"{_FP8_CORES}; a CPU has none (torchao emulates FP8 there)"),
        cpu_bf16=cpu_bf16,
    )


# --- CUDA ----------------------------------------------------------------------------------


# The answers about the device's own arithmetic and kernels (not the host CPU's).
_DEVICE_ANSWERS = ("tf32", "bf16", "fp16", "flash_sdpa", "efficient_sdpa", "cudnn_sdpa", "fp8")
_FP8_CORES = "FP8 tensor cores are on NVIDIA GPUs of sm89 (Ada) and newer"


def _no_cuda_capabilities(device: torch.device) -> Capabilities:
    built = torch.version.cuda or torch.version.hip
    why = (
        "CUDA is not available"
        + ("" if built else " (this PyTorch is a CPU-only build)")
        + f"; PyTorch {torch.__version__}"
    )
    return Capabilities(
        device=str(device),
        name="(no CUDA device)",
        compute_capability=None,
        cpu_bf16=_host_cpu_bf16(),
        **dict.fromkeys(_DEVICE_ANSWERS, Capability(False, why)),
    )


class _Gpu(NamedTuple):
    """What the answers about one CUDA (or ROCm) device are worked out from."""

    name: str  # torch.cuda.get_device_name
    arch: tuple[int, int]  # the compute capability, (major, minor)
    rocm: bool

    @property
    def sm(self) -> str:
        return f"sm{self.arch[0]}{self.arch[1]}"

    @property
    def ampere(self) -> bool:
        return self.arch >= (8, 0)


def _cuda_capabilities(device: torch.device) -> Capabilities:
    if not torch.cuda.is_available():
        return _no_cuda_capabilities(device)
    given: int | None = device.index
    index = given if given is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    gpu = _Gpu(name, (major, minor), torch.version.hip is not None)
    return Capabilities(
        device=str(torch.device("cuda", index)),
        name=name,
        compute_capability=(major, minor),
        tf32=_tf32(gpu),
        bf16=_bf16(gpu),
        fp16=_fp16(gpu),
        flash_sdpa=_flash_sdpa(gpu),
        efficient_sdpa=_efficient_sdpa(gpu),
        cudnn_sdpa=_cudnn_sdpa(gpu),
        fp8=_fp8(gpu),
        cpu_bf16=_host_cpu_bf16(),
    )


def _tf32(gpu: _Gpu) -> Capability:
    if gpu.rocm:
        return Capability(False, "TF32 is an NVIDIA tensor-core mode; this is a ROCm device")
    if not gpu.ampere:
        return Capability(False, f"{gpu.name} is {gpu.sm}; TF32 needs Ampere (sm80) or newer")
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return Capability(
            False,
            "NVIDIA_TF32_OVERRIDE=0 disables TF32 inside the CUDA libraries, whatever PyTorch's "
            "flags say",
        )
    return Capability(True, f"{gpu.name} is {gpu.sm} (Ampere or newer)")


def _bf16(gpu: _Gpu) -> Capability:
    if gpu.ampere or (gpu.rocm and _rocm_bf16()):
        return Capability(True, f"{gpu.name} ({gpu.sm}) has native bf16 tensor cores")
    return Capability(
        False, f"{gpu.name} is {gpu.sm}; native bf16 needs sm80 or newer (older GPUs emulate it)"
    )


def _fp16(gpu: _Gpu) -> Capability:
    if gpu.arch >= (7, 0):
        return Capability(True, f"{gpu.name} ({gpu.sm}) has fp16 tensor cores")
    if gpu.arch >= (5, 3):
        return Capability(
            True, f"{gpu.name} ({gpu.sm}) has native fp16 arithmetic (no tensor cores)"
        )
    return Capability(False, f"{gpu.name} is {gpu.sm}; native fp16 needs sm53 or newer")


def _flash_sdpa(gpu: _Gpu) -> Capability:
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not flash_built:
        return Capability(False, "this PyTorch build has no flash-attention kernel")
    if not gpu.ampere:
        return Capability(False, f"{gpu.name} is {gpu.sm}; PyTorch's flash attention needs sm80+")
    return Capability(True, f"{gpu.name} ({gpu.sm}) runs flash attention for fp16/bf16 inputs")


def _efficient_sdpa(gpu: _Gpu) -> Capability:
    if gpu.arch >= (5, 0):
        return Capability(True, f"{gpu.name} ({gpu.sm}) runs memory-efficient attention")
    return Capability(False, f"{gpu.name} is {gpu.sm}; memory-efficient attention needs sm50+")


def _cudnn_sdpa(gpu: _Gpu) -> Capability:
    cudnn_version = cudnn_version_or_none()
    if not hasattr(torch_C, "_set_sdp_use_cudnn"):
        return Capability(False, f"PyTorch {torch.__version__} has no cuDNN attention backend")
    if cudnn_version is None or cudnn_version < 90000:
        return Capability(False, f"cuDNN attention needs cuDNN 9; found {cudnn_version}")
    if not gpu.ampere:
        return Capability(False, f"{gpu.name} is {gpu.sm}; cuDNN attention needs sm80+")
    return Capability(True, f"{gpu.name} ({gpu.sm}) with cuDNN {cudnn_version}")


def _fp8(gpu: _Gpu) -> Capability:
    if gpu.rocm:
        return Capability(False, f"{_FP8_CORES}; this is a ROCm device")
    if gpu.arch < (8, 9):
        return Capability(False, f"{gpu.name} is {gpu.sm}; {_FP8_CORES}")
    if not (hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")):
        return Capability(False, f"PyTorch {torch.__version__} has no scaled float8 matmul")
    return Capability(True, f"{gpu.name} ({gpu.sm}) has FP8 tensor cores")


def cudnn_available() -> bool:
    """Whether this PyTorch build can use cuDNN (False on CPU-only builds)."""
    return bool(torch.backends.cudnn.is_available())  # type: ignore[no-untyped-call]


def cudnn_version_or_none() -> int | None:
    if not cudnn_available():
        return None
    version = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    return int(version) if version is not None else None


def _rocm_bf16() -> bool:
    is_bf16_supported: Any = torch.cuda.is_bf16_supported  # untyped, no argument, in 2.1
    try:
        return bool(is_bf16_supported(including_emulation=False))
    except TypeError:  # PyTorch before the including_emulation argument
        return bool(is_bf16_supported())
