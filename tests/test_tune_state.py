"""speedflags._tune's state reset: a train step starts every timed call from the same model,
optimizer, scheduler and RNG state, and tuning leaves them as they were.
"""

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from _tune_helpers import QUICK, row, ticking

from speedflags._tune import run
from speedflags._tune.state import StepState, find_state
from speedflags.levers.registry import LEVER_NAMES

ROOT = Path(__file__).resolve().parent.parent
NO_COMPILE = list(LEVER_NAMES)  # every registry lever, without torch.compile (too slow here)


# --- the state reset --------------------------------------------------------------------------


def _train_step() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(32, 8, generator=gen)
    starts: list[float] = []

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
        starts.append(float(sum(p.detach().double().sum() for p in model.parameters())))
        opt.zero_grad()
        h = x.view(4, 8, 8)
        loss = model(sdpa(h, h, h).view(32, 8)).square().mean()
        loss.backward()
        opt.step()
        return loss, model[0].weight.grad

    return {"step": step, "args": (model, opt, x), "starts": starts}


def test_a_train_step_starts_every_call_from_the_same_state() -> None:
    train = _train_step()
    model, opt, _ = train["args"]
    weights = [p.detach().clone() for p in model.parameters()]
    # sdpa=['flash'] runs the kernel the CPU picks anyway: with the weights, the optimizer's
    # moments and the dropout RNG put back, the candidate computes exactly what fp32 did
    result = run(
        train["step"], train["args"], {}, budget=1e-12, levers={"sdpa": ["flash"]},
        clock=ticking(), plan=QUICK,
    )  # fmt: skip
    assert row(result, sdpa=["flash"]).error == 0.0
    starts = train["starts"]
    # the priming call starts from the model as given; every later call from the state
    # it left (AdamW's moments exist: a steady-state step)
    assert len(starts) > 10 and len(set(starts[1:])) == 1 and starts[1] != starts[0]
    assert result.state.startswith("Sequential, AdamW; RNG")
    # and tune leaves the model and the optimizer as it found them
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert not opt.state


def test_without_the_reset_a_train_step_drifts(monkeypatch: pytest.MonkeyPatch) -> None:
    # the check above can fail: with restore() doing nothing, every call starts elsewhere
    monkeypatch.setattr(StepState, "restore", lambda self: None)
    train = _train_step()
    result = run(
        train["step"], train["args"], {}, budget=1e-12, levers={"sdpa": ["flash"]},
        clock=ticking(), plan=QUICK,
    )  # fmt: skip
    assert (row(result, sdpa=["flash"]).error or 0.0) > 1e-6
    assert len(set(train["starts"][1:])) > 1


def test_state_restores_modules_grads_optimizers_schedulers_and_the_rng() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 4)).sum().backward()  # a gradient before tuning is kept, too
    grad = model.weight.grad.clone()

    def step() -> float:
        noise = torch.randn(1, 4)
        loss = model(noise).sum()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    state = StepState(step, (), {})
    weight, lr = model.weight.detach().clone(), opt.param_groups[0]["lr"]
    step()
    state.settle()
    momentum = opt.state[model.weight]["momentum_buffer"]
    second, lr_second = step(), opt.param_groups[0]["lr"]
    step()
    state.restore()
    assert opt.state[model.weight]["momentum_buffer"] is momentum  # copied into, in place
    assert step() == second and opt.param_groups[0]["lr"] == lr_second
    state.finish()
    assert torch.equal(model.weight, weight) and torch.equal(model.weight.grad, grad)
    assert opt.param_groups[0]["lr"] == lr and not opt.state


def test_state_is_found_in_closures_partials_bound_methods_and_globals() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Trainer:
        def __init__(self) -> None:
            self.model = model

        def step(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    assert find_state(closure, (), {}) == [model]
    assert find_state(functools.partial(lambda o, x: x, opt), (), {}) == [opt]
    assert find_state(Trainer().step, (), {}) == []  # attributes are not searched: pass them
    assert find_state(Trainer().step, ({"opt": opt, "nets": [model]},), {}) == [opt, model]
    assert find_state(model, (), {}) == [model]


def test_a_forward_restores_only_the_rng() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    state = StepState(model, (torch.ones(2, 4),), {})
    first = model(torch.ones(2, 4))
    state.settle()
    assert not state.changes_state and "changes no state" in state.describe()
    state.restore()
    assert torch.equal(model(torch.ones(2, 4)), first)  # the same dropout mask


def test_an_optimizer_that_gained_a_param_group_is_refused_before_anything_is_copied() -> None:
    # Failed before: the state copy zipped the param groups and skipped the new one silently.
    from speedflags._tune.state import _copy_into

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW([model.weight], lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    moment = opt.state[model.weight]["exp_avg"].clone()
    opt.add_param_group({"params": [model.bias]})
    opt.state[model.weight]["exp_avg"].add_(1.0)
    assert _copy_into(opt, saved) is False  # the caller falls back to load_state_dict
    assert not torch.equal(opt.state[model.weight]["exp_avg"], moment)  # nothing copied
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(saved)


def test_a_tensor_learning_rate_is_copied_into_not_replaced() -> None:
    # Failed before: the restore put a copy in its place, so a compiled (CUDA-graphed) step
    # that reads the rate saw a new tensor after every restore.
    model = torch.nn.Linear(4, 2)
    lr = torch.tensor(0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step() -> float:
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    state = StepState(step, (), {})
    step()
    state.settle()  # the state every call starts from: the rate halved once
    step()
    step()
    live = opt.param_groups[0]["lr"]  # the tensor itself (2.13), or the one 2.1's StepLR made
    state.restore()
    assert opt.param_groups[0]["lr"] is live
    assert float(live) == pytest.approx(0.05)
    assert isinstance(lr, torch.Tensor)
    state.finish()
