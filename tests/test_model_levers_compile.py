"""The model levers and ``torch.compile``: a compiled model gives eager's result inside and
outside the block, and a graph traced under one state never serves the other.

Dynamo guards a module's class, so a model compiled before the block traces again inside it
(the shadow classes are new classes); where dynamo reads parameters without the class's
properties (PyTorch before ``inline_inbuilt_nn_modules``, 2.1 on the floor leg) the shadow
forward runs eagerly, out of the trace. Either way the numbers are eager's, which is what
these tests check, on every CI leg. (A forward hook added after compilation would be
ignored by an already compiled model: dynamo does not guard hooks by default,
``skip_nnmodule_hook_guards``; that is why the levers change classes, not hooks.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import speedflags

pytestmark = pytest.mark.usefixtures("cpu_with_bf16")


def convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 5),
    ).eval()  # fmt: skip


class Counting:
    """A torch.compile backend that runs the graph as traced and counts the graphs."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


def eager_inside(net: nn.Module, x: torch.Tensor, **levers: Any) -> torch.Tensor:
    with speedflags.fast_math(model=net, **levers), torch.no_grad():
        return net(x)


LEVERS = [
    {"param_dtype": "bf16"},
    {"memory_format": "channels_last"},
    {"param_dtype": "bf16", "memory_format": "channels_last"},
]


@pytest.mark.parametrize("levers", LEVERS, ids=lambda levers: "+".join(levers))
def test_a_model_compiled_before_the_block_follows_it_and_returns_after(
    levers: dict[str, Any],
) -> None:
    torch._dynamo.reset()
    net, x = convnet(), torch.randn(2, 3, 6, 6)
    backend = Counting()
    compiled = torch.compile(net, backend=backend)
    with torch.no_grad():
        plain = net(x)
        assert torch.equal(compiled(x), plain)
    graphs_outside = backend.graphs
    expected = eager_inside(net, x, **levers)
    if "param_dtype" in levers:
        assert not torch.equal(expected, plain)  # bf16 arithmetic inside: not fp32's
    # Failed before under -W error (InternalTorchDynamoError): dynamo warned at every trace
    # about a functools.cache helper of the shadow classes, a stray line in every user's log.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # dynamo's own, at every trace on that interpreter, with or without speedflags
        warnings.filterwarnings("ignore", "Guards may run slower on Python 3.13.0")
        with speedflags.fast_math(model=net, **levers), torch.no_grad():
            inside = compiled(x)
    assert torch.equal(inside, expected)
    with torch.no_grad():
        assert torch.equal(compiled(x), plain)  # the graph traced outside serves again
    assert backend.graphs >= graphs_outside


def test_a_model_compiled_inside_the_block_does_not_serve_its_graph_after() -> None:
    torch._dynamo.reset()
    net, x = convnet(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        plain = net(x)
    expected = eager_inside(net, x, param_dtype="bf16")
    compiled = torch.compile(net, backend=Counting())
    with speedflags.fast_math(model=net, param_dtype="bf16"), torch.no_grad():
        assert torch.equal(compiled(x), expected)
    with torch.no_grad():
        assert torch.equal(compiled(x), plain)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_inside_the_block_matches_eager(backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    twin = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    twin.load_state_dict(net.state_dict())
    x = torch.randn(8, 16)
    compiled = torch.compile(net, backend=backend)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        loss = compiled(x).pow(2).mean()
        loss.backward()
    with speedflags.fast_math(model=twin, param_dtype="bf16"):
        expected = twin(x).pow(2).mean()
        expected.backward()
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=1e-3)
    for mine, theirs in zip(net.parameters(), twin.parameters(), strict=True):
        assert mine.grad is not None and mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=5e-2, atol=5e-3)


def test_a_block_inside_a_compiled_function_runs_the_model_eagerly_with_its_levers() -> None:
    torch._dynamo.reset()
    net, x = convnet(), torch.randn(2, 3, 6, 6)
    expected = eager_inside(net, x, param_dtype="bf16")

    def step(batch: torch.Tensor) -> torch.Tensor:
        with speedflags.fast_math(model=net, param_dtype="bf16"), torch.no_grad():
            return net(batch)

    assert torch.equal(torch.compile(step, backend=Counting())(x), expected)
    assert not any("_speedflags_own_class" in type(m).__dict__ for m in net.modules())


def test_a_full_graph_of_a_model_under_a_lever_traces_or_says_why_not() -> None:
    torch._dynamo.reset()
    net, x = convnet(), torch.randn(2, 3, 6, 6)
    expected = eager_inside(net, x, param_dtype="bf16")
    compiled = torch.compile(net, backend=Counting(), fullgraph=True)
    config = torch._dynamo.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inlines = bool(getattr(config, "inline_inbuilt_nn_modules", False))
    with speedflags.fast_math(model=net, param_dtype="bf16"), torch.no_grad():
        if inlines:
            assert torch.equal(compiled(x), expected)
        else:  # PyTorch 2.1-2.4 by default: the shadow forward runs eagerly, no full graph
            with pytest.raises(speedflags.LeverInGraphError, match="inline_inbuilt_nn_modules"):
                compiled(x)
