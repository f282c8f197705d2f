"""GPU only: training with fp16 and a GradScaler, fused AdamW, compile, CUDA Graphs, NCCL.

Written before any GPU run, against PyTorch's documented behaviour and source, so that the
first run on a GPU confirms or refutes each expectation (``make gpu-check``). Every test
skips without a CUDA GPU.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import speedflags
from speedflags._measure.evidence import cuda_trace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()


def _batch(rows: int = 64, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(rows, 256, device="cuda", generator=gen) for _ in range(2)]


def test_fp16_autocast_with_grad_scaler_and_fused_adamw_trains() -> None:
    """fp16 autocast, an enabled ``grad_scaler("fp16", "cuda")`` and a fused AdamW step:
    the forward runs in fp16, the scaler scales (scale above 1) and steps, the fused kernel
    updates every parameter, the loss goes down, and the flags come back.

    PyTorch: ``torch.amp.GradScaler`` (torch/amp/grad_scaler.py: ``scale``, ``step`` unscales
    and skips on inf/NaN, ``update``), the CUDA autocast fp16 op lists
    (aten/src/ATen/autocast_mode.cpp: ``linear`` casts to the autocast dtype) and AdamW's
    ``fused=True`` CUDA path (torch/optim/adamw.py, ``_fused_adamw``).
    """
    model = _model()
    opt = speedflags.training.fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert opt.defaults["fused"] is True
    scaler = speedflags.training.grad_scaler("fp16", device="cuda")
    assert scaler.is_enabled()
    x, y = _batch()
    start = [p.detach().clone() for p in model.parameters()]
    before = speedflags.snapshot()

    @speedflags.speedup(amp="fp16", device="cuda")
    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return out.dtype, loss.detach()

    losses = []
    for _ in range(20):
        dtype, loss = step()
        assert dtype == torch.float16
        losses.append(float(loss))
    assert speedflags.snapshot() == before
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    assert scaler.get_scale() > 1.0
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))


def test_speedup_compiles_on_cuda_and_matches_eager() -> None:
    """``@speedup(compile=True, amp="bf16")`` compiles the step with inductor on CUDA (mode
    ``"compiled"``, no fallback) and gives eager's result within bf16 rounding.

    PyTorch: ``torch.compile`` with the default inductor backend generates Triton kernels
    for CUDA (torch/_inductor/compile_fx.py); autocast is traced into the graph
    (torch/_dynamo: autocast is a supported context).
    """
    model = _model()
    (x, _) = _batch()
    dtype = torch.bfloat16 if speedflags.capabilities("cuda").bf16 else torch.float16
    amp = "bf16" if dtype == torch.bfloat16 else "fp16"

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return model(inp).float()

    compiled = speedflags.speedup(compile=True, amp=amp, device="cuda", inference=True)(forward)
    eager = speedflags.speedup(amp=amp, device="cuda", inference=True)(forward)
    for _ in range(3):
        got = compiled(x)
    assert compiled.stats.mode == "compiled", compiled.stats
    torch.testing.assert_close(got, eager(x), rtol=2e-2, atol=2e-2)


def _graph_launches(call: Callable[[], Any]) -> int:
    _, trace = cuda_trace(call, CUDA)
    return sum(1 for op in trace.ops if "cudaGraphLaunch" in op)


def test_reduce_overhead_replays_cuda_graphs_and_a_new_shape_stays_correct() -> None:
    """``@speedup(compile={"mode": "reduce-overhead"})`` runs the step through CUDA Graphs
    (inductor's cudagraph trees): after the warm-up and recording calls, a call replays a
    graph (the profiler sees ``cudaGraphLaunch``). A new input shape re-records (or runs
    eagerly) and still gives eager's result: never a stale or wrong output.

    PyTorch: ``mode="reduce-overhead"`` turns on ``triton.cudagraphs``
    (torch/_inductor/config.py); torch/_inductor/cudagraph_trees.py warms up, records
    (``CUDAGraphNode``) and replays (``graph.replay()``), one graph per input shape. Outputs
    live in the graph's memory pool and are overwritten by the next replay, so each result
    is cloned before the next call, as the CUDA Graphs docs require.
    (``compile="reduce-overhead"``, a bare string, is not accepted by ``@speedup``: the mode
    goes in the options dict.)
    """
    model = _model().eval()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return model(inp)

    # plain fp32 levers: a bare @speedup would apply the recommended ones (TF32, bf16)
    graphed = speedflags.speedup(
        compile={"mode": "reduce-overhead"}, tf32=False, amp=False, device="cuda", inference=True
    )
    step = graphed(forward)
    (x, _) = _batch(64)
    with torch.inference_mode():
        expected = model(x).clone()
    results = [step(x).clone() for _ in range(4)]
    launches = _graph_launches(lambda: step(x).clone())
    assert step.stats.mode == "compiled", step.stats
    for got in results:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert launches >= 1, "no cudaGraphLaunch in a call after warm-up and recording"
    (other, _) = _batch(48, seed=7)  # a new batch size: a new graph or eager, never stale
    with torch.inference_mode():
        want = model(other).clone()
    for _ in range(3):
        torch.testing.assert_close(step(other).clone(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step(x).clone(), expected, rtol=1e-4, atol=1e-4)


def test_check_ranks_gathers_over_nccl_with_cuda_tensors(tmp_path: Path) -> None:
    """``check_ranks()`` in a one-rank NCCL group: the gather runs with CUDA tensors on the
    current device and reports the group as checked.

    PyTorch: NCCL collectives take CUDA tensors only (torch/distributed/distributed_c10d.py,
    ``all_gather``); speedflags' gather puts them on ``torch.cuda.current_device()``. One rank:
    NCCL refuses two ranks on one GPU.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("this PyTorch has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        result = speedflags.check_ranks()
    finally:
        dist.destroy_process_group()
    assert result.checked is True
    assert (result.world_size, result.backend, result.rank) == (1, "nccl", 0)
    assert result["tf32"] == speedflags.snapshot()["tf32"]
