"""tune and CUDA graphs: tried on a GPU for a launch-bound step, under the usual rules.

A CPU cannot show a GPU's profile or record a CUDA graph. Where a test needs the GPU branch,
it answers for the device (``graph_policy.unavailable``: CUDA graphs can work here), for
the profile (``judge``: launch-bound or not, with figures) and, where the recording is not
the subject, compiles through dynamo's ``aot_eager`` instead of inductor's graph trees;
the stage itself (the check, the calls, the timing, the row and the result) runs for real.
``tune``'s compile stage, inductor on this CPU (a minute or more per test), is left out here:
``tests/test_tune.py`` covers it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _cuda_graphs_helpers import train_step

import speedflags
from speedflags._compile import graph_policy as policy
from speedflags._tune import search as search_module
from speedflags._tune.graphs import BUSY_SHARE, MIN_KERNELS, launch_bound


@pytest.fixture(autouse=True)
def no_compile_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search_module.Search, "_compile", lambda self, fp32, best: None)


def gpu_here(monkeypatch: pytest.MonkeyPatch, bound: bool) -> None:
    monkeypatch.setattr(policy, "unavailable", lambda device: None)
    figures = "300 kernels keep the GPU busy 26% of the step (1.1 ms of 4.3 ms)"
    monkeypatch.setattr(search_module, "judge", lambda step, device, step_s: (bound, figures))


def _forward() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()), torch.randn(8, 16)


def test_launch_bound_is_many_kernels_that_leave_the_gpu_waiting() -> None:
    assert launch_bound(MIN_KERNELS, 0.1 * BUSY_SHARE, 0.1)[0] is False  # busy exactly half
    assert launch_bound(MIN_KERNELS, 0.099 * BUSY_SHARE, 0.1)[0] is True
    assert launch_bound(MIN_KERNELS - 1, 0.0, 0.1)[0] is False  # too few launches to win back
    assert launch_bound(50, 0.01, 0.0) == (False, "50 kernels keep the GPU busy 100% of the "
                                           "step (10 ms of 0 ms)")  # fmt: skip


def test_on_a_cpu_cuda_graphs_are_not_a_candidate() -> None:
    model, x = _forward()
    result = speedflags.tune(model, x, levers=["compile"], device="cpu", seconds=60)
    assert result.cuda_graphs is None
    assert not [row for row in result.rows if row.cuda_graphs]
    assert not [note for note in result.notes if "CUDA graphs" in note]
    assert result.to_dict()["tune"]["cuda_graphs"] is None


def test_a_step_that_is_not_launch_bound_is_not_tried_and_the_notes_say_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_here(monkeypatch, bound=False)
    model, x = _forward()
    result = speedflags.tune(model, x, levers=["compile"], device="cpu", seconds=60)
    assert result.cuda_graphs is None
    (note,) = [note for note in result.notes if "CUDA graphs" in note]
    assert note.startswith("note: CUDA graphs not tried: not launch-bound: 300 kernels keep")
    assert "cuda_graphs:" not in str(result)


def test_a_launch_bound_step_with_a_float_learning_rate_is_rejected_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_here(monkeypatch, bound=True)
    model, x = _forward()
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    result = speedflags.tune(step, x, levers=["compile"], device="cpu", seconds=60)
    (row,) = [row for row in result.rows if row.cuda_graphs]
    assert row.stage == "cuda_graphs" and row.label == "(fp32), cuda_graphs=True"
    assert not row.accepted and row.speedup is None
    assert row.note.startswith("raised CudaGraphsError: SGD param group 0: lr=0.01 is a Python")
    assert "lr=torch.tensor(0.01, device='cpu')" in row.note
    assert result.cuda_graphs is False
    assert any(n.startswith("note: CUDA graphs tried: launch-bound: 300") for n in result.notes)


def test_a_launch_bound_step_is_timed_beside_fp32_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_here(monkeypatch, bound=True)
    monkeypatch.setattr(policy, "graph_options", lambda given, shown: {"backend": "aot_eager"})
    model, x = _forward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aot_eager's own deprecation notices on some versions
        result = speedflags.tune(model, x, levers=["compile"], device="cpu", seconds=60)
    (row,) = [row for row in result.rows if row.cuda_graphs]
    assert row.error is not None and row.error < 1e-5  # the same arithmetic, compiled
    assert row.speedup is not None and row.rounds > 0
    assert isinstance(result.cuda_graphs, bool) and result.cuda_graphs == row.accepted
    assert "cuda_graphs: speedup(cuda_graphs=True, ...)" in str(result)
