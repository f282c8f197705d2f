"""The host CPU: its instructions, and what the installed PyTorch runs on it, found by trying.

A CPU capability is two facts, and both must hold. The instructions: AVX512-BF16, AMX-BF16
or Arm BF16 for bf16; AMX-FP16 or AVX512-FP16 for fp16 (without them PyTorch emulates the
dtype, slower than fp32). And the installed PyTorch's CPU kernels for the dtype: PyTorch 2.1
has no float16 matmul on a CPU (``"addmm_impl_cpu_" not implemented for 'Half'``) and no
bfloat16 ``mse_loss``, whatever the CPU offers. Flags alone cannot tell; trying can.

Each answer is found once per process and kept in :data:`_cache` (tests fake a CPU by
putting their answer there):

- :func:`cpu_features`: the instruction sets, from PyTorch's own cpuinfo probes
  (``torch.cpu._is_*_supported``, PyTorch 2.3+) and else ``/proc/cpuinfo``'s flags.
- :func:`cpu_kernels`: a tiny matmul, a linear layer's backward and an ``mse_loss`` in the
  dtype, each tried and every exception caught. The trial runs in a thread of its own, so
  the caller's thread-local state (autocast, grad and inference mode, a dispatch mode, a
  ``torch.compile`` trace) neither changes what it finds nor is touched by it; it writes no
  torch state and uses no random number generator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._locks import new_lock
from .answers import Capability

__all__ = [
    "CpuFeatures",
    "KernelTrial",
    "cpu_dtype",
    "cpu_features",
    "cpu_kernels",
    "emulation_cost",
]


@dataclass(frozen=True)
class CpuFeatures:
    """The host CPU's instruction sets that decide bf16 and fp16 speed.

    Example:
        >>> from speedflags._hardware import CpuFeatures
        >>> CpuFeatures(amx_bf16=True, avx512_bf16=True).bf16_instructions()
        'AMX tiles (AMX-BF16)'
        >>> CpuFeatures().fp16_instructions()
        ''
    """

    name: str = ""
    isa: str = ""  # PyTorch's kernel level: torch.backends.cpu.get_cpu_capability()
    avx512_bf16: bool = False
    amx_bf16: bool = False
    amx_fp16: bool = False
    avx512_fp16: bool = False
    arm_bf16: bool = False

    def bf16_instructions(self) -> str:
        """The best bf16 instructions in words, or ``""`` where there are none."""
        if self.amx_bf16:
            return "AMX tiles (AMX-BF16)"
        if self.avx512_bf16:
            return "AVX512-BF16 instructions"
        return "Arm BF16 instructions" if self.arm_bf16 else ""

    def fp16_instructions(self) -> str:
        """The fp16 instructions in words, or ``""`` where there are none."""
        found = [name for name, has in (("AMX-FP16", self.amx_fp16),
                                        ("AVX512-FP16", self.avx512_fp16)) if has]  # fmt: skip
        return " and ".join(found) + " instructions" if found else ""


@dataclass(frozen=True)
class KernelTrial:
    """What the installed PyTorch did with tiny operations in one dtype on the CPU.

    ``missing`` holds ``(operation, PyTorch's message)`` for each operation that raised.
    The matmul and the linear backward are what autocast and half-precision weights need;
    a missing one means PyTorch refuses the dtype here. The loss is tried only where they
    run (autocast keeps losses in float32, so a missing one is a note, not a refusal).

    Example:
        >>> from speedflags._hardware import KernelTrial
        >>> trial = KernelTrial("float16", (("matmul", "not implemented for 'Half'"),))
        >>> trial.runs, trial.missing_one(("matmul", "linear backward"))
        (False, ('matmul', "not implemented for 'Half'"))
    """

    dtype: str
    missing: tuple[tuple[str, str], ...] = ()

    @property
    def runs(self) -> bool:
        """Whether every operation autocast and half-precision weights need ran."""
        return self.missing_one(REQUIRED) is None

    def missing_one(self, operations: tuple[str, ...]) -> tuple[str, str] | None:
        """The first of ``operations`` that raised, with PyTorch's message, or None."""
        return next((m for m in self.missing if m[0] in operations), None)


def _matmul(dtype: torch.dtype) -> None:
    a = torch.ones(4, 4, dtype=dtype, device="cpu")
    a @ a


def _linear_backward(dtype: torch.dtype) -> None:
    weight = torch.ones(4, 4, dtype=dtype, device="cpu", requires_grad=True)
    F.linear(torch.ones(2, 4, dtype=dtype, device="cpu"), weight).sum().backward()  # type: ignore[no-untyped-call, unused-ignore]


def _loss(dtype: torch.dtype) -> None:
    x = torch.ones(4, dtype=dtype, device="cpu")
    F.mse_loss(x, torch.zeros_like(x))


REQUIRED = ("matmul", "linear backward")
_OPERATIONS: tuple[tuple[str, Callable[[torch.dtype], None]], ...] = (
    ("matmul", _matmul),
    ("linear backward", _linear_backward),
    ("mse_loss", _loss),
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def _try(dtype: torch.dtype) -> KernelTrial:
    missing: list[tuple[str, str]] = []
    for name, operation in _OPERATIONS:
        if name not in REQUIRED and missing:
            break  # the dtype is refused already; its loss would only add a warning
        try:
            # a fresh thread's default; explicit for the inline case (untyped in 2.1's stubs)
            with torch.enable_grad():  # type: ignore[no-untyped-call, unused-ignore]
                operation(dtype)
        except Warning:
            pass  # it ran; PyTorch's warning about it became an error under -W error
        except Exception as exc:  # whatever PyTorch raises for a dtype it lacks
            missing.append((name, _first_line(exc)))
    return KernelTrial(str(dtype).replace("torch.", ""), tuple(missing))


def try_cpu_kernels(dtype: torch.dtype) -> KernelTrial:
    """Try ``dtype``'s operations now, in a thread of its own (uncached; :func:`cpu_kernels`
    keeps the answer)."""
    found: list[KernelTrial] = []
    thread = threading.Thread(
        target=lambda: found.append(_try(dtype)), name="speedflags dtype trial", daemon=True
    )
    try:
        thread.start()
    except RuntimeError:  # no new thread here (interpreter shutting down, a thread limit)
        return _try(dtype)
    thread.join()
    return found[0] if found else KernelTrial(str(dtype), (("matmul", "the trial did not end"),))


def _cpuinfo() -> tuple[str, frozenset[str]]:
    # frozenset(), not frozenset[str](): dynamo 2.11 fails on calling a generic alias when
    # the first capabilities() of a process is asked inside torch.compile
    name = ""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:  # not Linux: the torch.cpu probes answer instead
        return name, flags
    for line in lines:
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = val.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(val.split())
        if name and flags:
            break
    return name, flags


def _feature(torch_probe: str, flags: frozenset[str], flag: str) -> bool:
    # torch.cpu._is_*_supported (2.3+) asks cpuinfo inside PyTorch (and, for AMX, whether the
    # kernel lets this process use the tiles); /proc/cpuinfo is the fallback before 2.3.
    probe = getattr(torch.cpu, torch_probe, None)
    return bool(probe()) if probe is not None else flag in flags


def read_cpu_features() -> CpuFeatures:
    """The host CPU's instruction sets, read now (uncached: see :func:`cpu_features`)."""
    name, flags = _cpuinfo()
    isa: Any = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return CpuFeatures(
        name=name,
        isa=str(isa),
        avx512_bf16=_feature("_is_avx512_bf16_supported", flags, "avx512_bf16"),
        amx_bf16=_feature("_is_amx_tile_supported", flags, "amx_bf16"),
        amx_fp16=_feature("_is_amx_fp16_supported", flags, "amx_fp16"),
        avx512_fp16="avx512_fp16" in flags,  # PyTorch has no probe for it
        arm_bf16="bf16" in flags,  # aarch64 /proc/cpuinfo "Features"
    )


# "features" -> CpuFeatures; a torch.dtype -> its KernelTrial. Tests fake a CPU by setting
# entries (monkeypatch.setitem), then clear speedflags._hardware's answers built from them.
_cache: dict[Any, Any] = {}
_lock = new_lock()  # reentrant: a signal handler asking mid-trial must not deadlock


def _cached(key: Any, find: Callable[[], Any]) -> Any:
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = find()
    return found


def cpu_features() -> CpuFeatures:
    """The host CPU's instruction sets (read once per process).

    Example:
        >>> from speedflags._hardware import cpu_features
        >>> cpu_features() is cpu_features()
        True
    """
    found: CpuFeatures = _cached("features", read_cpu_features)
    return found


def cpu_kernels(dtype: torch.dtype) -> KernelTrial:
    """What the installed PyTorch runs in ``dtype`` on the CPU (tried once per process).

    Example:
        >>> import torch
        >>> from speedflags._hardware import cpu_kernels
        >>> cpu_kernels(torch.bfloat16).runs  # PyTorch 2.1 runs bf16 matmuls too
        True
    """
    found: KernelTrial = _cached(dtype, lambda: try_cpu_kernels(dtype))
    return found


# The fact, and nothing measured elsewhere: the tools that measure it here (verify, bench,
# tune) print their own figure beside it, and a figure from another machine would contradict
# it (fp16 measured 5.6x slower on one CPU, where "40 to 1000 times" was said).
_NO_INSTRUCTIONS = {
    torch.bfloat16: "no AVX512-BF16, AMX or Arm BF16 instructions: bf16 on this CPU is "
    "emulated, slower than fp32",
    torch.float16: "no AVX512-FP16 or AMX-FP16 instructions: fp16 on this CPU is emulated, "
    "slower than fp32",
}
# What emulation cost on the CPUs measured: for words that measure nothing themselves (the
# warning of a block entered on such a CPU), never beside a figure measured here.
_MEASURED_ELSEWHERE = {
    torch.bfloat16: "tens of times slower than fp32 on the CPUs measured: a 1024x1024 matmul "
    "45x with 2 threads, 80x with 1, on an AVX2 AMD EPYC",
    torch.float16: "several to tens of times slower than fp32 on the CPUs measured: a "
    "256x256 matmul 5.6x with 1 thread, 66x with 2, on an AVX512-BF16 AMD EPYC",
}


def emulation_cost(dtype: torch.dtype) -> str:
    """What computing in ``dtype`` (bfloat16 or float16) cost on the CPUs measured without
    its instructions, and how to measure it here: for a message that measures nothing.

    Example:
        >>> import torch
        >>> from speedflags._hardware.cpu import emulation_cost
        >>> emulation_cost(torch.bfloat16)[:30]
        'tens of times slower than fp32'
    """
    said = _MEASURED_ELSEWHERE.get(dtype, "slower than fp32")
    return f"{said}; python -m speedflags verify measures it here"


def cpu_dtype(dtype: torch.dtype) -> Capability:
    """Whether ``dtype`` (bfloat16 or float16) runs natively on the host CPU here, and why.

    Native means both: the CPU has the instructions, and the installed PyTorch runs the
    dtype's matmul and its backward on the CPU (tried, once). ``missing_kernel`` marks the
    second failing: PyTorch refuses the dtype here, whatever the CPU offers.

    Example:
        >>> import torch
        >>> from speedflags._hardware import cpu_dtype
        >>> cap = cpu_dtype(torch.float16)
        >>> cap.supported or "fp16" in cap.reason or "float16" in cap.reason
        True
    """
    features = cpu_features()
    bf16 = dtype == torch.bfloat16
    has = features.bf16_instructions() if bf16 else features.fp16_instructions()
    if not has:
        return Capability(False, _NO_INSTRUCTIONS[torch.bfloat16 if bf16 else torch.float16])
    trial = cpu_kernels(dtype)
    refused = trial.missing_one(REQUIRED)
    version = f"PyTorch {torch.__version__}"
    if refused is not None:
        operation, message = refused
        why = f"the CPU has {has}, but {version} has no {trial.dtype} {operation} on CPU"
        return Capability(False, f"{why} ({message})", missing_kernel=True)
    reason = f"the CPU has {has}, and {version} runs {trial.dtype} matmuls on it"
    if trial.missing_one(("mse_loss",)) is not None:
        reason += f" (but no {trial.dtype} mse_loss: keep losses in float32, as autocast does)"
    return Capability(True, reason)
