"""GPU only: the ``fp8`` lever on FP8 tensor cores (compute capability 8.9 or newer).

Written before any GPU run, against torchao's float8 training and PyTorch's scaled matmul,
so that the first run on such a GPU confirms or refutes each expectation (``make gpu-check``
runs ``tests/test_gpu_*.py``). Every test skips without a CUDA GPU of sm89 or newer, or
without torchao (``pip install 'speedflags[fp8]'``), saying which.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import speedflags
from speedflags._measure.evidence import cuda_trace
from speedflags.levers import _torchao

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="needs FP8 tensor cores (compute capability 8.9 or newer)",
    ),
    pytest.mark.skipif(_torchao.missing() is not None, reason=f"{_torchao.missing()}"),
]
D = 4096


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D), nn.Linear(D, 16)).cuda()


def _state(model: nn.Module) -> list[Any]:
    return [(name, id(m), type(m)) for name, m in model.named_modules()] + [
        (name, id(p), p.dtype) for name, p in model.named_parameters()
    ]


def test_the_block_runs_the_scaled_fp8_matmul_natively_and_restores_the_model() -> None:
    """Inside the block the large layers are torchao's ``Float8Linear`` without emulation,
    and a forward launches PyTorch's scaled matmul (``aten::_scaled_mm``, cuBLAS's FP8 GEMM);
    after it every module and parameter is the model's own again."""
    net = _model()
    x = torch.randn(64, D, device="cuda")
    before = _state(net)
    with speedflags.fast_math(model=net, fp8=True, device="cuda", strict=True):
        assert net[0].config.emulate is False
        with torch.no_grad():
            out, trace = cuda_trace(lambda: net(x), torch.device("cuda"))
    assert any("_scaled_mm" in op for op in trace.ops), sorted(trace.ops)
    assert trace.kernels
    with torch.no_grad():
        reference = net.double()(x.double())
    net.float()
    error = float((out.double() - reference).norm() / reference.norm())
    assert 1e-2 < error < 1e-1, error  # FP8's level
    assert _state(net) == before


def test_a_fused_adamw_training_step_in_fp8_lowers_the_loss() -> None:
    """Forward, backward (its gradient GEMMs in FP8 too) and a fused AdamW step on the
    float32 parameters, per step as ``@speedup`` enters the block."""
    net = _model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(256, D, device="cuda"), torch.randn(256, 16, device="cuda")

    @speedflags.speedup(model=net, fp8=True, amp="bf16", device="cuda")
    def step() -> torch.Tensor:
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [float(step()) for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert [type(m) for m in net] == [nn.Linear, nn.GELU, nn.Linear, nn.Linear]


def test_weight_bound_inference_casts_each_weight_once_and_matches_torchao() -> None:
    net = _model().eval()
    x = torch.randn(4, D, device="cuda")
    with speedflags.fast_math(model=net, fp8=True, device="cuda"):
        with torch.enable_grad():
            uncached = net(x).detach()
        with torch.inference_mode():
            first = net(x)
            made = net[0].__dict__["_speedflags_fp8_cast"][2]
            again = net(x)
            assert net[0].__dict__["_speedflags_fp8_cast"][2] is made
    assert torch.equal(first, again) and torch.equal(first, uncached)


def test_verify_proves_the_scaled_matmul_ran() -> None:
    run = speedflags.verify("cuda", levers=["fp8"])
    for value in ("tensorwise", "rowwise"):
        verdict = run.verdict("fp8", value)
        assert verdict.status == "verified", str(run)
        assert verdict.measured["scaled_mm"] and verdict.measured["arithmetic"] == "fp8"
    assert run.restored
