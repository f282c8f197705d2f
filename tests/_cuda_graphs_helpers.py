"""What the CUDA graphs test files share: a train step over a model and its optimizer."""

from __future__ import annotations

from collections.abc import Callable

import torch


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step: the mean square of the model's output as the loss, backward, the optimizer's
    step; returns the loss, detached."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step
