"""The small models the model-lever tests share, each built from seed 0."""

from __future__ import annotations

import torch
from torch import nn


def mlp(outputs: int = 4) -> nn.Sequential:
    """Linear, LayerNorm, GELU, Linear: 8 features in, ``outputs`` out."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, outputs))


def convnet(outputs: int = 5) -> nn.Sequential:
    """Conv2d, BatchNorm2d, ReLU, Flatten, Linear: 3×6×6 images in, ``outputs`` out."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, outputs),
    )  # fmt: skip


Seen = tuple[str, torch.dtype, bool, bool]


def conv_parts(pixels: int) -> tuple[nn.Conv2d, nn.BatchNorm2d, nn.Linear]:
    """A convolution (3 -> 4 channels), its BatchNorm, and a Linear head for ``pixels``."""
    return nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4 * pixels, 1)


def seen_in_forward(training: bool, weight: torch.Tensor) -> Seen:
    """What a forward sees of a weight under the model levers: (phase, its dtype, whether
    it is in channels_last, whether autocast is on)."""
    from conftest import autocast_enabled  # the suite's: reads torch directly

    layout = bool(weight.is_contiguous(memory_format=torch.channels_last))
    channels_last = layout and not weight.is_contiguous()
    return ("train" if training else "eval", weight.dtype, channels_last, autocast_enabled("cpu"))
