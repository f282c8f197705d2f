"""``memory_format``: the weights come back in their own tensors, the block may be entered in
inference mode, and what a channels_last block leaves in the tensors it made (outputs,
gradients, optimizer state, checkpoints).
"""

from __future__ import annotations

import io

import pytest
import torch
from _small_models import convnet
from torch import nn

import speedflags

pytestmark = pytest.mark.usefixtures("cpu_with_bf16")

CL = torch.channels_last


def channels_last(t: torch.Tensor) -> bool:
    return bool(t.is_contiguous(memory_format=CL)) and not t.is_contiguous()


def test_a_weight_viewing_a_flat_buffer_comes_back_as_that_view() -> None:
    # Failed before: the exit gave the weight a fresh storage at offset 0, and writes through
    # the flat buffer no longer reached it.
    flat = torch.zeros(10 + 8 * 3 * 3 * 3)
    conv = nn.Conv2d(3, 8, 3, bias=False)
    conv.weight = nn.Parameter(flat[10:].view(8, 3, 3, 3))
    nn.init.normal_(conv.weight)
    weight, stride = conv.weight, conv.weight.stride()
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1)
    with speedflags.fast_math(model=conv, memory_format="channels_last"):
        assert channels_last(weight)
        conv(torch.randn(1, 3, 5, 5)).sum().backward()
        optimizer.step()
        trained = weight.detach().clone()
    assert conv.weight is weight and weight.stride() == stride
    assert weight.storage_offset() == 10
    assert weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(weight, trained)  # the update made inside is kept
    flat[10] = 7.0  # and the buffer reaches the weight again
    assert weight.view(-1)[0].item() == 7.0


def test_a_block_entered_in_inference_mode_leaves_no_inference_tensors() -> None:
    # Failed before: the weights converted inside torch.inference_mode() stayed inference
    # tensors, and every later training step failed ("Inference tensors cannot be saved for
    # backward").
    net = convnet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    @torch.inference_mode()
    def evaluate() -> torch.Tensor:
        with speedflags.fast_math(model=net, memory_format="channels_last", param_dtype="bf16"):
            return net(torch.randn(2, 3, 6, 6))

    assert evaluate().dtype == torch.float32
    assert not any(p.is_inference() for p in net.parameters())
    net(torch.randn(2, 3, 6, 6)).sum().backward()  # trains afterwards
    optimizer.step()
    with torch.inference_mode():  # a model made in inference mode keeps its inference weights
        frozen = convnet()
    with torch.inference_mode(), speedflags.fast_math(model=frozen, memory_format="channels_last"):
        frozen(torch.randn(1, 3, 6, 6))
    assert all(p.is_inference() for p in frozen.parameters())
    assert frozen[0].weight.is_contiguous()


class Segmenter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        return y, y.flatten(1)  # flatten/reshape work on any layout; .view may not


def test_outputs_come_back_in_the_inputs_layout_and_grads_in_the_weights() -> None:
    # Decided: 4-D outputs come back contiguous when the inputs were, so y.view(...) after the
    # model works as without the block; inside the model, channels_last activations are
    # PyTorch's (use reshape or flatten, not view, across the channel dimension).
    net = Segmenter()
    x = torch.randn(2, 3, 5, 5)
    with speedflags.fast_math(model=net, memory_format="channels_last"):
        y, _ = net(x)
        assert y.is_contiguous() and y.view(2, -1).shape == (2, 100)
        y_cl, _ = net(x.contiguous(memory_format=CL))
        assert channels_last(y_cl)  # given channels_last, kept channels_last
        y.sum().backward()
        assert channels_last(net.conv.weight.grad)
    assert net.conv.weight.is_contiguous() and net.conv.weight.grad.is_contiguous()


def test_optimizer_state_made_inside_keeps_its_layout_and_every_implementation_steps_on() -> None:
    # Decided: an optimizer's state made inside the block keeps channels_last strides (the
    # values are right, and for-loop, foreach and fused steps take it); the weights and their
    # gradients get their own strides back.
    for options in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        net = convnet()
        try:
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, **options)
        except RuntimeError:  # PyTorch 2.1: fused=True is for CUDA devices only
            continue
        x = torch.randn(2, 3, 6, 6)
        with speedflags.fast_math(model=net, memory_format="channels_last"):
            net(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = optimizer.state[net[0].weight]["exp_avg"]
        assert channels_last(state) and net[0].weight.is_contiguous()
        before = net[0].weight.detach().clone()
        net(x).sum().backward()
        optimizer.step()
        assert not torch.equal(net[0].weight, before)


def test_a_checkpoint_saved_inside_has_the_weights_own_layout() -> None:
    # safetensors (the Hugging Face Trainer's format) refuses non-contiguous tensors
    net = convnet()
    with speedflags.fast_math(model=net, memory_format="channels_last", param_dtype="bf16"):
        assert channels_last(net[0].weight)
        state = net.state_dict()
        kept = net.state_dict(keep_vars=True)
        buffer = io.BytesIO()
        torch.save(net.state_dict(), buffer)
    assert all(t.is_contiguous() and t.dtype is not torch.bfloat16 for t in state.values())
    assert kept["0.weight"] is net[0].weight  # keep_vars: the Parameter itself
    assert torch.equal(state["0.weight"], net[0].weight)
    buffer.seek(0)
    assert torch.load(buffer)["0.weight"].is_contiguous()
