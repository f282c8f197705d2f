"""``memory_format``'s weights: convolution weights into ``channels_last`` and back, exactly.

Entering converts each 4-D convolution weight's data to ``channels_last`` in place (``weight.data
= ...``: the same Parameter object) and keeps the tensor it had. Exiting copies the values
(updated inside the block or not) back into that tensor and gives it back to the weight: the
same storage, offset and strides as before, so a weight that views a larger buffer (a flat
parameter buffer) is a view of it again, and writes through the buffer reach it again. Its
gradient, if one was computed inside the block, gets the weight's strides back too; an
optimizer's state made inside the block keeps channels_last strides (PyTorch's for-loop,
``foreach`` and fused optimizers all take a state whose strides differ from the weight's).

While the block is open the weight has a storage of its own (NHWC is another order of the
same values), so its own tensor is held beside it: the block costs the convolution weights'
size again. Conversions run outside ``torch.inference_mode`` (a block entered inside an
``@torch.inference_mode()`` function must not leave inference tensors behind in a model that
trains afterwards), except for a weight that was an inference tensor already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ._model_state import ModelState

__all__ = ["CONVS", "own_layout", "restrided", "to_channels_last", "to_own_layouts"]

CONVS: tuple[type, ...] = (nn.Conv2d, nn.ConvTranspose2d)
Converted = list[tuple[nn.Parameter, torch.Tensor]]  # (weight, the data it had), to undo


def convertible(module: nn.Module) -> nn.Parameter | None:
    """The 4-D convolution weight of ``module`` that ``memory_format`` converts, or None."""
    if not isinstance(module, CONVS):
        return None
    weight = module._parameters.get("weight")
    if weight is None or nn.parameter.is_lazy(weight):
        return None  # a lazy convolution before its first call: nothing to convert yet
    return weight if weight.dim() == 4 else None


@contextlib.contextmanager
def _outside_inference_mode() -> Iterator[None]:
    with torch.no_grad():
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                yield
        else:
            yield


def to_channels_last(modules: list[nn.Module], state: ModelState, converted: Converted) -> None:
    """Convert the convolution weights of ``modules`` not converted yet; record each in
    ``state.layouts`` and, to undo a failure, in ``converted``."""
    with _outside_inference_mode():
        for module in modules:
            weight = convertible(module)
            if weight is None or id(weight) in state.layouts:
                continue
            data = weight.data
            if data.is_inference():  # keep it one: the model cannot train anyway
                with torch.inference_mode():
                    new = data.contiguous(memory_format=torch.channels_last)
            else:
                new = data.contiguous(memory_format=torch.channels_last)
            if new is data:  # channels_last already
                continue
            converted.append((weight, data))
            state.layouts[id(weight)] = (weight, data)
            weight.data = new


def to_own_layouts(state: ModelState, converted: Converted) -> None:
    """Give each converted weight its own tensor back, with the values it has now."""
    with _outside_inference_mode():
        for weight, own in list(state.layouts.values()):
            current = weight.data
            converted.append((weight, current))
            weight.data = _back(current, own)
            grad = weight.grad
            if grad is not None and grad.shape == own.shape and grad.stride() != own.stride():
                weight.grad = restrided(grad, tuple(own.stride()))
            del state.layouts[id(weight)]


def _back(current: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    # the weight's own tensor, holding the current values; a fresh one in the own strides if
    # the weight's dtype, device or shape changed inside the block (model.half() there)
    same = (current.dtype, current.device, current.shape) == (own.dtype, own.device, own.shape)
    if not same:
        return restrided(current, tuple(own.stride()))
    if own.is_inference():
        with torch.inference_mode():
            own.copy_(current)
    else:
        own.copy_(current)
    return own


def own_layout(state: ModelState, weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (the weight, or a detached view of it) in the weight's own strides if the
    block converted it, else ``value``: what ``state_dict()`` gives inside the block, so that
    a checkpoint saved there is laid out as one saved outside (``safetensors`` refuses
    non-contiguous tensors)."""
    saved = state.layouts.get(id(weight))
    if saved is None or saved[0] is not weight:
        return value
    return restrided(value, tuple(saved[1].stride()))


def restrided(data: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``data``'s values with the strides ``stride`` (a copy; the same values, bit for bit)."""
    if tuple(data.stride()) == stride:
        return data
    out = torch.empty_strided(data.shape, stride, dtype=data.dtype, device=data.device)
    out.copy_(data)
    return out
