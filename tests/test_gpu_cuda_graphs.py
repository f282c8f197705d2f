"""GPU only: @speedup(cuda_graphs=True) records and replays CUDA graphs, safely.

Written before any GPU run, against PyTorch's documented behaviour and source (inductor's
cudagraph trees, ``torch/_inductor/cudagraph_trees.py``; the compiled optimizer with a
tensor learning rate), so that the first run on a GPU confirms or refutes each expectation.
Every test skips without a CUDA GPU; the same rules are tested on the CPU in
``tests/test_cuda_graphs.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
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
TOLERANCE = 3e-2  # bf16 keeps 8 mantissa bits


def _trainer(graphed: bool, lr: Any = None, amp: Any = "bf16") -> tuple[Any, nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    rate = torch.tensor(1e-3, device=CUDA) if lr is None else lr
    opt = speedflags.training.fast_optimizer(torch.optim.AdamW, model.parameters(), lr=rate)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x).float(), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    decorated = speedflags.speedup(amp=amp, device="cuda", cuda_graphs=graphed)(step)
    return decorated, model, opt


def _batches(rows: int = 32, count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(rows, 64, device="cuda", generator=gen) for _ in range(count)]


def _graph_launches(call: Callable[[], Any]) -> int:
    _, trace = cuda_trace(call, CUDA)
    return sum(1 for op in trace.ops if "cudaGraphLaunch" in op)


def test_a_train_step_replays_cuda_graphs_and_matches_eager() -> None:
    """After the warm-up and recording calls a step replays graphs (``cudaGraphLaunch``),
    compiled with CUDA graphs on, and trains as eager does within bf16's tolerance."""
    step, _, _ = _trainer(graphed=True)
    eager, _, _ = _trainer(graphed=False)
    batches = _batches()
    got = [float(step(x)) for x in batches * 2]
    want = [float(eager(x)) for x in batches * 2]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) < TOLERANCE
    assert step.stats.mode == "compiled", step.stats
    assert step.stats.cuda_graphs.state == "on"
    assert step.stats.compile_options == {"options": {"triton.cudagraphs": True}}
    assert _graph_launches(lambda: step(batches[0])) >= 1


def test_a_scheduler_changing_the_rate_every_call_neither_recompiles_nor_freezes() -> None:
    """The rate, a tensor on the GPU that the scheduler fills in place, reaches every replay
    (the same losses as eager within bf16's tolerance) and dynamo compiles nothing after the
    warm-up calls."""
    from torch._dynamo.utils import counters

    losses: dict[bool, list[float]] = {}
    counts: list[int] = []
    batches = _batches()
    for graphed in (False, True):
        step, _, opt = _trainer(graphed)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
        losses[graphed] = []
        for i in range(12):
            losses[graphed].append(float(step(batches[i % len(batches)])))
            sched.step()
            if graphed:
                counts.append(int(counters["stats"]["unique_graphs"]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False], strict=True))
    assert worst < TOLERANCE, (losses, worst)
    assert counts[3:] == [counts[3]] * len(counts[3:]), counts


def test_a_float_learning_rate_is_refused_before_the_step_runs() -> None:
    step, model, _ = _trainer(graphed=True, lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(speedflags.CudaGraphsError, match=r"lr=torch\.tensor\(0\.001, device"):
        step(_batches()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_twenty_distinct_shapes_fall_back_after_the_limit_with_one_warning() -> None:
    step, _, _ = _trainer(graphed=True)
    eager, _, _ = _trainer(graphed=False)
    batches = [_batches(rows, 1)[0] for rows in range(16, 36)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", speedflags.CudaGraphsWarning)
        got = [float(step(x)) for x in batches]
    want = [float(eager(x)) for x in batches]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) < TOLERANCE
    said = [w for w in caught if "past the limit" in str(w.message)]
    assert len(said) == 1
    graphs = step.stats.cuda_graphs
    assert (graphs.recorded, graphs.beyond_limit, graphs.eager_calls) == (8, 12, 12)


def test_outputs_kept_across_calls_are_not_overwritten_by_later_replays() -> None:
    model = nn.Linear(64, 64).cuda().eval()

    @speedflags.speedup(cuda_graphs=True, device="cuda", amp=False, tf32=False, inference=True)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    batches = _batches(count=6)
    kept = [forward(x) for x in batches]  # replays from the third call on: one output memory
    with torch.inference_mode():
        for x, out in zip(batches, kept, strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
