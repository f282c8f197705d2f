"""``param_dtype`` in the training loops users write: a block held around many optimizer steps,
evaluation blocks inside a float32 loop, and the hooks that follow the optimizer.

The cast cache renews a cast when its parameter changed, and a fused optimizer changes the
weights without bumping their version counters: the renewal must come from the optimizer's
step itself (PyTorch's global step hook, registered only while a model-lever block is open).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import _small_models as small_models
import pytest
import torch
from conftest import global_hook_counts
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import speedflags
from speedflags.levers import _model_casts, _model_state

pytestmark = pytest.mark.usefixtures("cpu_with_bf16")

BF16 = torch.bfloat16
IMPLEMENTATIONS = ["for-loop", "foreach", "fused"]


def mlp() -> nn.Sequential:
    return small_models.mlp(outputs=1)


def convnet() -> nn.Sequential:
    return small_models.convnet(outputs=1)


def adamw(params: Any, implementation: str, lr: float = 1e-2) -> torch.optim.AdamW:
    """AdamW with the implementation asked for; a PyTorch without it on the CPU skips."""
    options: dict[str, Any] = (
        {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
    )
    try:
        return torch.optim.AdamW(params, lr=lr, **options)
    except RuntimeError as exc:  # PyTorch 2.1: fused=True is for CUDA devices only
        pytest.skip(f"PyTorch {torch.__version__} has no {implementation} AdamW on a CPU: {exc}")


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    return x, x[:, :1] * 2.0 - x[:, 1:2]


def autocast_losses(implementation: str, steps: int) -> list[float]:
    """The losses of the same loop under torch.autocast, from the same initialisation."""
    x, y = regression_data()
    twin = mlp()
    optimizer = adamw(twin.parameters(), implementation)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", BF16):
            loss = (twin(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def held_block_losses(
    implementation: str, steps: int, compiled: Callable[[Any], Any] | None = None
) -> list[float]:
    """The losses of a loop held inside one param_dtype block (``compiled``: makes the
    optimizer's step as called, e.g. compiled)."""
    x, y = regression_data()
    net = mlp()
    optimizer = adamw(net.parameters(), implementation)
    step = compiled(optimizer) if compiled is not None else optimizer.step
    losses = []
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        for _ in range(steps):
            loss = (net(x) - y).pow(2).mean()
            loss.backward()
            step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_twenty_adamw_steps_held_inside_one_block_train_like_autocast(implementation: str) -> None:
    # Failed before with fused=True: the fused step updates the weights in place without
    # bumping their version counters, the cast cache kept the first step's casts, and the
    # loss stayed at its first value for all 20 steps.
    ours = held_block_losses(implementation, 20)
    assert len(set(ours)) == 20  # every step moved the loss
    assert ours[-1] < 0.5 * ours[0]
    torch.testing.assert_close(ours, autocast_losses(implementation, 20), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_float32_loop_evaluating_in_blocks_ends_bitwise_equal_to_the_loop_without(
    implementation: str,
) -> None:
    # Evaluation under param_dtype every 3 steps, BatchNorm included: the evaluation changes
    # nothing the float32 training sees (weights, statistics, optimizer state, RNG).
    x = torch.randn(16, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    y = torch.randn(16, 1, generator=torch.Generator().manual_seed(3))

    def train(evaluate: bool) -> nn.Module:
        net = convnet()
        optimizer = adamw(net.parameters(), implementation, lr=1e-3)
        for step in range(10):
            net.train()
            (net(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if evaluate and step % 3 == 0:
                net.eval()
                with torch.no_grad(), speedflags.fast_math(model=net, param_dtype="bf16"):
                    assert net(x).dtype == torch.float32
        return net

    plain, evaluated = train(False), train(True)
    for (name, a), b in zip(
        plain.state_dict().items(), evaluated.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_casts_follow_a_fused_step_without_a_version_bump() -> None:
    # what the renewal rests on: the fused step leaves the version counter and the pointer
    # as they were, and the cast made after it is made from the new weights
    net = nn.Linear(4, 4, bias=False)
    optimizer = adamw(net.parameters(), "fused", lr=0.5)
    x = torch.ones(1, 4, dtype=BF16)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net(x).float().sum().backward()
        version, pointer = net.weight._version, net.weight.data_ptr()
        optimizer.step()
        assert (net.weight._version, net.weight.data_ptr()) == (version, pointer)
        with torch.no_grad():
            after = net(x)
    expected = torch.nn.functional.linear(x, net.weight.detach().to(BF16))
    assert torch.equal(after, expected)


def test_a_write_through_data_outside_a_step_is_not_seen_and_a_plain_write_is() -> None:
    # The documented exception, as autograd's own cache: an in-place write through .data
    # outside an optimizer's step bumps nothing. Written without .data, it is seen; and an
    # optimizer that writes through .data inside its step() is seen too (the step hook).
    net = nn.Linear(2, 2, bias=False)
    x = torch.ones(1, 2)
    with torch.no_grad(), speedflags.fast_math(model=net, param_dtype="bf16"):
        first = net(x)
        net.weight.data.mul_(2.0)
        assert torch.equal(net(x), first)  # the cast of before: not seen
        net.weight.mul_(0.5)  # through autograd's view: seen
        expected = torch.nn.functional.linear(x.to(BF16), net.weight.to(BF16))
        assert torch.equal(net(x), expected.float())

    class DataSGD(torch.optim.Optimizer):  # an older optimizer's style: writes through .data
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.5})

        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-group["lr"])

    optimizer = DataSGD(net.parameters())
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net(x).sum().backward()
        with torch.no_grad():
            before = net(x)
        optimizer.step()
        with torch.no_grad():
            after = net(x)
    assert not torch.equal(after, before)
    expected = torch.nn.functional.linear(x.to(BF16), net.weight.detach().to(BF16))
    assert torch.equal(after, expected.float())


def test_speedflags_fast_optimizer_trains_inside_a_held_block() -> None:
    # fast_optimizer picks fused=True where this PyTorch has it on the device
    x, y = regression_data()
    net = mlp()
    optimizer = speedflags.training.fast_optimizer(torch.optim.AdamW, net.parameters(), lr=1e-2)
    losses = []
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        for _ in range(10):
            loss = (net(x) - y).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert len(set(losses)) == 10 and losses[-1] < losses[0]


def test_the_global_hooks_are_set_while_any_block_is_open_and_gone_after_the_last() -> None:
    none = global_hook_counts()
    first, second = mlp(), convnet()
    with speedflags.fast_math(model=first, param_dtype="bf16"):
        inside = global_hook_counts()
        # the optimizer step pre- and post-hooks, the module and parameter registration hooks
        assert [b - a for a, b in zip(none, inside, strict=True)] == [1, 1, 1, 1, 0]
        with speedflags.fast_math(model=second, memory_format="channels_last"):
            assert global_hook_counts() == inside  # once, however many models
        with speedflags.fast_math(model=first, param_dtype=False):  # off, inside an outer block
            assert global_hook_counts() == none
        assert global_hook_counts() == inside
    assert global_hook_counts() == none
    assert _model_state.active_states() == ()


def test_finding_whether_steps_are_seen_inside_a_block_costs_no_cast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first cast for training in a process asks whether PyTorch calls the step hooks, by
    # stepping a one-element SGD while the block's hooks are on: that step was counted, and
    # the next forward cast every weight again (3 casts for 2 micro-batches and a step, alone
    # in a fresh process; 2 after any other test had asked). Forgotten here, asked again.
    monkeypatch.setattr(_model_casts, "_SEEN", {})
    net = nn.Linear(4, 4, bias=False)
    x = torch.ones(2, 4)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        steps = _model_casts.steps_taken()
        first = net(x)
        assert _model_casts._SEEN  # the question was asked, inside the block
        assert _model_casts.steps_taken() == steps  # its step is not counted
        (state,) = _model_state.active_states()
        ((*_, cast),) = state.casts.values()  # nor did it empty the cache
        assert torch.equal(net(x), first)
        ((*_, again),) = state.casts.values()
        assert again is cast  # the second forward reused the first one's cast


def test_an_optimizer_step_elsewhere_only_renews_casts() -> None:
    # the hook counts steps; a step of another model's optimizer costs a cast, changes nothing
    if not _model_casts.steps_are_seen():
        pytest.skip(f"PyTorch {torch.__version__} calls no step hooks here (torch.compile ran)")
    net, other = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.ones(1, 2)
    with torch.no_grad(), speedflags.fast_math(model=net, param_dtype="bf16"):
        before = net(x)
        steps = _model_casts.steps_taken()
        optimizer.step()  # no gradients: changes nothing, still a step
        assert _model_casts.steps_taken() == steps + 1
        assert torch.equal(net(x), before)


def _a_step_fires_the_hooks() -> bool:
    fired: list[int] = []
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    handle = register_optimizer_step_post_hook(lambda *a: fired.append(1))
    try:
        torch.optim.SGD([param], lr=0.1).step()
    finally:
        handle.remove()
    return bool(fired)


def test_whether_pytorch_calls_the_step_hooks_is_known_before_and_after_a_compile() -> None:
    # PyTorch 2.1's dynamo takes every built-in optimizer's hook wrapper away at the first
    # torch.compile of the process; later versions keep it. Each is asked, never assumed.
    assert _model_casts.steps_are_seen() == _a_step_fires_the_hooks()
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    assert _model_casts.steps_are_seen() == _a_step_fires_the_hooks()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_where_no_step_hook_runs_training_casts_are_renewed_after_their_backward(
    implementation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mocked here: the answer of a PyTorch whose optimizer steps run no global hooks (2.1 once
    # torch.compile has run: the real path on the floor leg). Casts made for training are
    # then dropped once their backward ran, so even a fused step is followed.
    monkeypatch.setattr(_model_casts, "steps_are_seen", lambda: False)
    ours = held_block_losses(implementation, 20)
    torch.testing.assert_close(ours, autocast_losses(implementation, 20), rtol=2e-2, atol=1e-3)


def test_a_compiled_optimizer_step_renews_the_casts() -> None:
    # where dynamo keeps the step hooks they renew the casts; where it takes them away (2.1),
    # the backward does; inductor's in-place updates bump no version counter on 2.1
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))  # 2.1: takes the hooks
    # where the hooks are gone, inductor's step (no version bump) is the case that froze
    backend = "eager" if _model_casts.steps_are_seen() else "inductor"
    try:
        ours = held_block_losses(
            "for-loop", 6, lambda optimizer: torch.compile(optimizer.step, backend=backend)
        )
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(ours, autocast_losses("for-loop", 6), rtol=2e-2, atol=1e-3)


def test_a_deep_copy_of_the_model_trains_on_its_own() -> None:
    # copies made inside the block are ordinary models; the original keeps its own casts
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        twin = copy.deepcopy(net)
    assert not any("_speedflags_own_class" in type(m).__dict__ for m in twin.modules())
