"""GPU only: the levers under ``torch.compile`` with inductor on CUDA.

What the CPU matrix (tests/test_compile_matrix.py) shows with CPU kernels, shown here with
the kernels the levers exist for: cuBLAS in TF32 through either API family, cuDNN
convolutions (TF32, autotuning), and each fused SDPA kernel, each reached from compiled code
in the places a user sets levers (``@speedup(compile=True)``, a block around a compiled
call, a block inside the compiled function). Written before any GPU run, against PyTorch's
source; every test skips without a CUDA GPU. Errors are measured against float64 results, so
a lever that compiled code ignored fails the error bounds, not only the flag reads.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from test_compile_matrix import LEVERS, check_cell
from test_gpu_kernels import KERNEL_WORDS, SDPA_OPS, _math, _qkv, _supported
from test_gpu_tf32 import FP32_MAX, TF32_MAX, TF32_MIN

import speedflags
from speedflags import SpeedflagsWarning, fast_math, speedup
from speedflags._measure.evidence import cuda_trace

AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not AMPERE, reason="TF32 and bf16 need an Ampere GPU"
    ),
]
CUDA = torch.device("cuda")
BASELINE = {"tf32": False, "matmul_precision": "highest", "device": "cuda"}
# the two API families a user may reach TF32 through: speedflags' tf32 lever (which writes
# the family this PyTorch uses) and torch.set_float32_matmul_precision's (the legacy one)
TF32_WAYS = {"tf32": {"tf32": True}, "matmul_precision": {"matmul_precision": "high"}}
# where the levers are set: @speedup(compile=True); a block around a call of
# guard_levers(fn) or of a plain torch.compile(fn); a block inside the compiled function
PLACES = ("speedup", "around_guarded", "around_plain", "inside_compiled_function")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_speedflags_warnings() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in caught if issubclass(w.category, SpeedflagsWarning)] == []


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _compiled_in(place: str, levers: dict[str, Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with inductor, the levers set in ``place``; called like ``fn``."""
    levers = {**levers, "device": "cuda"}
    if place == "speedup":
        return speedup(compile=True, **levers)(fn)
    if place.startswith("around"):
        compiled = speedflags.guard_levers(fn) if place == "around_guarded" else torch.compile(fn)

        def around(*args: Any) -> Any:
            with fast_math(**levers):
                return compiled(*args)

        return around

    def inside(*args: Any) -> Any:  # a process-wide lever: a graph break around the block
        with fast_math(**levers):
            return fn(*args)

    return torch.compile(inside)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("way", sorted(TF32_WAYS))
def test_compiled_matmul_runs_in_tf32_through_either_api_family(
    way: str, place: str, no_speedflags_warnings: None
) -> None:
    """A compiled float32 matmul multiplies in TF32 where the lever is set (error about
    three decades above fp32's), in fp32 where it is not, and every getter reads as before
    afterwards. No "mix of the legacy and new APIs" error: dynamo saves and writes back the
    resolved ``cuda.matmul`` precision around each frame it compiles
    (torch/_dynamo/convert_frame.py), which must not leave a mixed state behind.

    PyTorch: inductor lowers a plain mm to ``extern_kernels.mm`` (cuBLAS), which reads
    ``float32Precision("cuda", "matmul")`` at run time (aten/src/ATen/cuda/CUDABlas.cpp).
    """
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=gen) for _ in range(2))
    ref = a.double() @ b.double()
    before = speedflags.snapshot()
    step = _compiled_in(place, TF32_WAYS[way], _mm)
    with fast_math(**BASELINE):
        on = _relative_error(step(a, b), ref)
        on_again = _relative_error(step(a, b), ref)  # from the compiled cache
        off = _relative_error(torch.compile(_mm)(a, b), ref)
    assert speedflags.snapshot() == before
    torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - raises on a mixed TF32 state
    torch.get_float32_matmul_precision()
    assert TF32_MIN < on < TF32_MAX, f"{way} in {place}: error {on:.2e}, not TF32 (off {off:.2e})"
    assert on_again == on
    assert off < FP32_MAX, f"compiled without the lever: error {off:.2e}, not fp32"


def _conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


@pytest.mark.parametrize("place", PLACES)
def test_compiled_conv_follows_tf32_and_cudnn_benchmark(
    place: str, no_speedflags_warnings: None
) -> None:
    """A compiled 3x3 convolution runs in cuDNN with TF32 where ``tf32=True`` is set, in fp32
    where it is not; ``cudnn_benchmark=True`` reads True where the kernel runs (a probe kept
    out of the graph) and False after.

    PyTorch: inductor keeps convolutions as ``extern_kernels.convolution`` (aten's cuDNN path,
    torch/_inductor/kernel/conv.py without max-autotune), which reads ``cudnn.benchmark`` and
    the conv TF32 flag at run time (aten/src/ATen/native/cudnn/Conv_v8.cpp).
    """
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 64, 32, 32, device="cuda", generator=gen)
    w = torch.randn(64, 64, 3, 3, device="cuda", generator=gen) * (64 * 9) ** -0.5
    ref = F.conv2d(x.double(), w.double(), padding=1)
    seen: list[bool] = []
    probe = torch.compiler.disable(lambda: seen.append(torch.backends.cudnn.benchmark))

    def conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        probe()
        return _conv(x, w)

    before, benchmark_before = speedflags.snapshot(), torch.backends.cudnn.benchmark
    step = _compiled_in(place, {"tf32": True, "cudnn_benchmark": True}, conv)
    with fast_math(**BASELINE, cudnn_benchmark=False), torch.no_grad():
        on = _relative_error(step(x, w), ref)
        off = _relative_error(torch.compile(_conv)(x, w), ref)
    assert speedflags.snapshot() == before
    assert seen == [True], seen
    assert torch.backends.cudnn.benchmark is benchmark_before
    assert TF32_MIN < on < TF32_MAX, f"{place}: conv error {on:.2e}, not TF32 (off {off:.2e})"
    assert off < FP32_MAX, f"compiled without the lever: conv error {off:.2e}, not fp32"


@pytest.mark.parametrize("place", [p for p in PLACES if p != "around_plain"])
@pytest.mark.parametrize("backend", sorted(SDPA_OPS))
def test_compiled_attention_runs_the_preferred_sdpa_kernel(
    backend: str, place: str, no_speedflags_warnings: None
) -> None:
    """Compiled bf16 attention runs the preferred fused kernel (its ATen operator and its
    CUDA kernels in the profiler) and matches float64 attention at bf16 level.

    PyTorch: AOT autograd traces ``scaled_dot_product_attention`` through its CUDA dispatch,
    which picks the kernel from the enabled backends and their priority order at trace time
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); inductor keeps the chosen op as
    a fallback kernel (torch/_inductor/lowering.py). So the preference must be in force when
    the function is traced: in @speedup, around a ``guard_levers`` compile, or by the graph
    break a block inside the function makes. Not around a plain ``torch.compile``: neither
    dynamo's guards nor the AOT autograd cache key on the SDPA flags, so a graph traced
    under one preference serves the next (seen on the H200: flash and efficient preferences
    ran the cuDNN graph compiled before them; docs/compile.md).
    """
    _supported(backend)
    q, k, v = _qkv(torch.bfloat16)
    before = speedflags.snapshot()
    step = _compiled_in(place, {"sdpa": backend}, F.scaled_dot_product_attention)
    with torch.no_grad():
        step(q, k, v)  # compiles
        out, trace = cuda_trace(lambda: step(q, k, v), CUDA)
    assert speedflags.snapshot() == before
    ops = sorted(o for o in trace.ops if "scaled_dot" in o)
    assert any(SDPA_OPS[backend] in op for op in ops), f"{backend} in {place}: operators {ops}"
    names = [name.lower() for name in trace.distinct_kernels()]
    assert any(word in name for name in names for word in KERNEL_WORDS[backend]), names[:8]
    error = _relative_error(out, _math(q, k, v))
    assert error < 2e-2, f"{backend} in {place}: relative error {error:.2e} against float64"


# The CPU matrix's cells on CUDA with inductor, where a block may break the graph
# (with_block) and where the levers go around the compiled step (speedup).
CUDA_CELLS = [
    pytest.param(place, lever, id=f"{place}-{lever}")
    for place in ("with_block", "speedup")
    for lever in LEVERS
]


@pytest.mark.parametrize(("place", "lever"), CUDA_CELLS)
def test_matrix_cell_on_cuda(place: str, lever: str, caplog: pytest.LogCaptureFixture) -> None:
    """tests/test_compile_matrix.py's check of one cell (eager's numbers, the lever in force
    where it runs and restored after, the ledger's records, no speedflags warning or dynamo
    log line naming speedflags), with CUDA tensors and inductor."""
    with caplog.at_level(logging.WARNING):
        check_cell(place, lever, False, "inductor", caplog, "cuda")
