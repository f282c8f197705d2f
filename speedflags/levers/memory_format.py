"""The ``memory_format`` lever: a model's 4-D convolution weights and 4-D floating inputs in
``channels_last`` (NHWC), the layout cuDNN's and oneDNN's fastest convolution kernels take.

The weights stay the same Parameter objects: each one's data is converted in place and, on
exit, its own tensor (storage, offset, strides) comes back holding the values it has then
(updates made inside the block are kept). Inputs are converted at the model's boundary, and
4-D outputs come back contiguous when the inputs were. Mechanism:
:mod:`speedflags.levers._model_layout` and :mod:`speedflags.levers._model_shadow`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from ..errors import InvalidTypeError, InvalidValueError
from ._base import Effect
from ._model_lever import OFF, ModelLever
from .spec import declare

__all__ = [
    "CHANNELS_LAST",
    "MemoryFormatLever",
    "memory_format_effect",
    "validate_memory_format",
]

CHANNELS_LAST = "channels_last"
CHOICES = "'channels_last', torch.channels_last or False"


def validate_memory_format(value: object) -> str | None:
    """Normalise a ``memory_format=`` argument: ``"channels_last"``, or ``None`` (``False``).

    Example:
        >>> import torch
        >>> from speedflags.levers.memory_format import validate_memory_format
        >>> validate_memory_format(torch.channels_last), validate_memory_format(False)
        ('channels_last', None)
    """
    if value is False:
        return None
    if value == CHANNELS_LAST or value is torch.channels_last:
        return CHANNELS_LAST
    if isinstance(value, (str, torch.memory_format)):
        raise InvalidValueError(f"not a layout speedflags sets; valid: {CHOICES}")
    raise InvalidTypeError(f"expected {CHOICES}, got {type(value).__name__}")


class MemoryFormatLever(ModelLever):
    """``memory_format="channels_last"`` (or ``False``) on one model.

    Scope: model. Restores each convolution weight's own tensor (the same Parameter, its own
    storage and strides, the values it has then) and the model's own class.

    Example:
        >>> import torch, speedflags
        >>> net = torch.nn.Conv2d(3, 8, 3)
        >>> with speedflags.fast_math(model=net, memory_format="channels_last"):
        ...     net.weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> net.weight.is_contiguous()
        True
    """

    name = "memory_format"
    field = "channels_last"

    validate = staticmethod(validate_memory_format)

    def configured(self, model: nn.Module) -> Hashable:
        config = self.config(model)
        return CHANNELS_LAST if config is not None and config[1] else OFF

    def to_field(self, value: Any) -> Any:
        return value == CHANNELS_LAST

    def describe_value(self, value: Any) -> Any:
        return False if value is None or value is OFF else value

    def available(self, value: Any, device: torch.device) -> Effect:
        return memory_format_effect(value, device)


def memory_format_effect(value: str | None, device: torch.device) -> Effect:
    """channels_last changes which convolution kernels run on CUDA (cuDNN) and CPUs
    (oneDNN) alike."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return Effect(False, f"no effect on {device}: PyTorch sees no CUDA device")
    return Effect(True, "")


DECLARED = (
    declare(
        MemoryFormatLever.of,
        name="memory_format",
        scope="model",
        validate=validate_memory_format,
        effect_of=memory_format_effect,
        describe=lambda value: False if value is None else value,
        order=90,
        values="'channels_last', torch.channels_last or False (with model=)",
        summary=(
            "the model's 4-D convolution weights and 4-D inputs in channels_last (NHWC), the "
            "layout cuDNN's and oneDNN's fastest convolutions take"
        ),
        accuracy="none in principle (a different convolution kernel may round differently)",
        baseline=False,
        candidates=("channels_last",),
        ops=("conv",),
        # no dynamo_misses: dynamo guards the weights' strides and the model's class
    ),
)
