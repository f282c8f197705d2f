"""GPU only: cuDNN autotuning and SDPA kernel choice, seen in the profiler.

Written before any GPU run, against PyTorch's documented behaviour and source, so that the
first run on a GPU confirms or refutes each expectation (``make gpu-check``). Every test
skips without a CUDA GPU. What ran is read from ``torch.profiler`` (CPU-side ATen operators
and the CUDA kernels launched), through ``speedflags._measure.evidence.cuda_trace``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import speedflags
from speedflags import fast_math
from speedflags._measure.evidence import Trace, cuda_trace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
SDPA_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}
# words expected in the kernels' names (lower case): FlashAttention-2's flash_fwd_kernel,
# the CUTLASS memory-efficient kernel (fmha_cutlassF_..., PyTorchMemEffAttention::
# AttentionKernel), cuDNN's generated SDPA engines (cudnn_generated_..._sdpa_...)
KERNEL_WORDS = {
    "flash": ("flash",),
    "efficient": ("fmha", "attentionkernel", "memeff"),
    "cudnn": ("cudnn", "sdpa"),
}


def _conv_kernels(side: int, benchmark: bool) -> tuple[Trace, Trace]:
    gen = torch.Generator(device="cuda").manual_seed(side)
    x = torch.randn(4, 40, side, side, device="cuda", generator=gen)
    w = torch.randn(40, 40, 3, 3, device="cuda", generator=gen)
    with fast_math(cudnn_benchmark=benchmark, tf32=False, device="cuda"), torch.no_grad():
        _, first = cuda_trace(lambda: F.conv2d(x, w, padding=1), CUDA)
        _, later = cuda_trace(lambda: F.conv2d(x, w, padding=1), CUDA)
    return first, later


def test_cudnn_benchmark_autotunes_and_leaves_enabled_and_deterministic_alone() -> None:
    """With ``cudnn_benchmark=True`` the first call of a new shape runs the autotuner, which
    launches the candidate algorithms' kernels; later calls launch the chosen one. Without
    it, the first call launches what later calls launch. ``enabled`` and ``deterministic``
    read the same before, inside and after.

    PyTorch: ``torch.backends.cudnn.benchmark`` ("causes cuDNN to benchmark multiple
    convolution algorithms and select the fastest", torch/backends/cudnn/__init__.py; up to
    ``benchmark_limit`` = 10 of them); aten/src/ATen/native/cudnn/Conv_v8.cpp times the
    execution plans (``get_plans_from_find``) and caches the winner per shape
    (``benchmark_cache``). Each test call uses a shape of its own, so no cache hides the
    tuning.
    """
    cudnn = torch.backends.cudnn
    around = (cudnn.enabled, cudnn.deterministic)
    with fast_math(cudnn_benchmark=True, device="cuda"):
        assert cudnn.benchmark is True
        assert (cudnn.enabled, cudnn.deterministic) == around
    assert cudnn.benchmark is False and (cudnn.enabled, cudnn.deterministic) == around
    first, later = _conv_kernels(37, benchmark=True)
    control_first, control_later = _conv_kernels(41, benchmark=False)
    shown = (
        f"benchmark: first call {len(first.kernels)} kernels {first.distinct_kernels()[:6]}, "
        f"later {len(later.kernels)}; without: {len(control_first.kernels)} and "
        f"{len(control_later.kernels)}"
    )
    assert len(first.kernels) >= len(later.kernels) + 2, shown
    assert len(first.distinct_kernels()) >= 2, shown
    assert len(control_first.kernels) - len(control_later.kernels) < (
        len(first.kernels) - len(later.kernels)
    ), shown


def _qkv(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(
        torch.randn(2, 8, 256, 64, device="cuda", generator=gen).to(dtype) for _ in range(3)
    )


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    return (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1) @ v


def _supported(backend: str) -> None:
    cap = getattr(speedflags.capabilities("cuda"), f"{backend}_sdpa")
    if not cap:
        pytest.skip(f"{backend} attention cannot run here: {cap.reason}")


@pytest.mark.parametrize("backend", sorted(SDPA_OPS))
def test_each_sdpa_preference_runs_that_kernel(backend: str) -> None:
    """``sdpa=backend`` on bf16 (2, 8, 256, 64) inputs runs that backend's operator and its
    kernels, and the result matches float64 attention at bf16 level.

    PyTorch: the dispatcher (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
    ``select_sdp_backend``) walks the priority order over the enabled backends; speedflags
    puts the preferred one first (``torch._C._set_sdp_priority_order``) and keeps math
    enabled after it. The operator names are the ATen ops in torch/_C/_VariableFunctions.pyi.
    """
    _supported(backend)
    dtype = torch.bfloat16 if speedflags.capabilities("cuda").bf16 else torch.float16
    q, k, v = _qkv(dtype)
    with fast_math(sdpa=backend, device="cuda"), torch.no_grad():
        out, trace = cuda_trace(lambda: F.scaled_dot_product_attention(q, k, v), CUDA)
    ops = sorted(o for o in trace.ops if "scaled_dot" in o)
    assert any(SDPA_OPS[backend] in op for op in ops), f"{backend}: operators {ops}"
    assert not any("_scaled_dot_product_attention_math" in op for op in ops), ops
    names = [name.lower() for name in trace.distinct_kernels()]
    assert any(word in name for name in names for word in KERNEL_WORDS[backend]), names[:8]
    ref = _math(q, k, v)
    error = float((out.double() - ref).norm() / ref.norm())
    assert error < 2e-2, f"{backend}: relative error {error:.2e} against float64"


@pytest.mark.parametrize("backend", sorted(SDPA_OPS))
def test_an_input_the_preferred_kernel_refuses_falls_back_to_math(backend: str) -> None:
    """float64 inputs: no fused kernel takes them (flash and cuDNN take fp16/bf16, the
    memory-efficient kernel also fp32), so the preference falls back to math, with the right
    result and no "No available kernel" error; asked alone, the kernel refuses.

    PyTorch: ``check_tensor_dtype`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp;
    ``torch.nn.attention.sdpa_kernel`` (2.3+) enables one backend alone.
    """
    _supported(backend)
    q, k, v = _qkv(torch.float64)
    with fast_math(sdpa=backend, device="cuda"), torch.no_grad():
        out, trace = cuda_trace(lambda: F.scaled_dot_product_attention(q, k, v), CUDA)
    ops = sorted(o for o in trace.ops if "scaled_dot" in o)
    assert any("_scaled_dot_product_attention_math" in op for op in ops), ops
    assert not any(SDPA_OPS[backend] in op for op in ops), ops
    torch.testing.assert_close(out, _math(q, k, v))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]  # fmt: skip
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch says why each kernel refuses
        with sdpa_kernel([chosen]), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)


def test_verify_on_the_gpu_verifies_every_lever_it_can() -> None:
    """``speedflags.verify("cuda")``: every lever value verified or without effect here (on an
    A100/H100 every one is verified), every flag restored, and the time it took recorded (how
    long is measured by the GPU check's verify step, never asserted here)."""
    run = speedflags.verify("cuda")
    assert run.ok, str(run)
    assert run.restored
    statuses = {v.label: v.status for v in run.verdicts}
    assert statuses["cudnn_benchmark=True"] == "verified", str(run)
    assert statuses["amp='bf16'" if speedflags.capabilities("cuda").bf16 else "amp='fp16'"] == (
        "verified"
    ), str(run)
    assert run.elapsed_s is not None and run.elapsed_s > 0, run.elapsed_s
