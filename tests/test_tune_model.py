"""``tune(..., model=net)``: the model levers as candidates, with the output's gap to fp32
after several steps for ``param_dtype``.

Run with the CPU's bf16 answer faked to "native" (``cpu_with_bf16``: the arithmetic is real,
emulated or not), so that the candidates are raced rather than timed once; what is asserted
never depends on which is faster."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import speedflags
from speedflags.errors import InvalidTypeError, InvalidValueError


def _train_step() -> tuple[nn.Module, object, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return net, step, (torch.randn(16, 32), torch.randn(16, 32))


@pytest.mark.usefixtures("cpu_with_bf16")
def test_given_the_model_param_dtype_is_a_candidate_with_its_gap_after_several_steps() -> None:
    net, step, batch = _train_step()
    result = speedflags.tune(
        step, *batch, budget=0.1, seconds=60, levers={"param_dtype": ["bf16"]}, model=net
    )
    (row,) = [r for r in result.rows if r.levers == {"param_dtype": "bf16"}]
    assert row.error is not None and 0 < row.error < 0.1  # bf16 arithmetic, within budget
    assert row.drift is not None and math.isfinite(row.drift) and row.drift > 0
    assert "output gap to fp32 after several steps" in str(result)
    assert not any("_speedflags_own_class" in type(m).__dict__ for m in net.modules())


def test_without_a_model_a_model_lever_asked_for_says_why_it_was_not_tried() -> None:
    _, step, batch = _train_step()
    result = speedflags.tune(
        step, *batch, budget=0.1, seconds=30, levers={"param_dtype": ["bf16"], "tf32": [True]}
    )
    (row,) = [r for r in result.rows if r.levers == {"param_dtype": "bf16"}]
    assert row.note == "skipped (no model): give tune(..., model=net) to try it"
    assert row.speedup is None


def test_a_bad_model_is_refused_before_anything_runs() -> None:
    _, step, batch = _train_step()
    with pytest.raises(InvalidTypeError, match=r"tune\(model='net'\): expected a torch.nn.Module"):
        speedflags.tune(step, *batch, model="net")
    with pytest.raises(InvalidValueError, match="model= is for the model levers"):
        speedflags.tune(step, *batch, levers=["tf32"], model=nn.Linear(2, 2))


@pytest.mark.usefixtures("cpu_with_bf16")
def test_a_step_that_is_a_module_is_the_model() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    result = speedflags.tune(
        net, torch.randn(8, 32), budget=0.1, seconds=30, levers=["param_dtype"]
    )
    rows = {tuple(r.levers.items()): r for r in result.rows}
    row = rows[(("param_dtype", "bf16"),)]
    assert (
        row.error is not None
        and row.note != "skipped (no model): give tune(..., model=net) to try it"
    )
