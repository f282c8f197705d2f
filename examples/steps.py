"""The step ``python -m speedflags tune`` measures in the README: a small MLP's train step.

``make_step()`` is the factory the command names (``FILE.py:FACTORY``): it builds the model,
its optimizer and one batch, and returns ``(train_step, (model, optimizer, x, y))``. tune
calls ``train_step(model, optimizer, x, y)`` in plain fp32, then under each lever the device
offers, putting the model's weights, the optimizer's moments and the RNG back before every
call, and keeps the fastest levers whose error stays within ``--budget``::

    python -m speedflags tune examples/steps.py:make_step --budget 0.01 --seconds 120 \\
        --out levers.json --plot pareto.png

The step returns the loss and the first layer's weight gradient: a loss alone shows the
forward pass's accuracy only, and the gradient shows the backward's. Replace the model and
the batch with your own; keep the shape of the factory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WIDTH = 512  # the MLP's hidden width: big enough for the levers to matter on a CPU
BATCH = 64


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; the loss and the first layer's weight gradient."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x).float(), y)  # the loss in fp32 under autocast too
    loss.backward()
    first: Any = model[0]
    grad = first.weight.grad.detach().clone()
    optimizer.step()
    return loss.detach(), grad


def make_step() -> tuple[Any, tuple[Any, ...]]:
    """``(train_step, (model, optimizer, x, y))`` on CUDA if there is a GPU, else the CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layers = (nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, generator=generator).to(device)
    y = torch.randn(BATCH, WIDTH, generator=generator).to(device)
    return train_step, (model, optimizer, x, y)
