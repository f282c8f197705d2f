"""@speedup(compile=...): the step's own errors are not compiler failures.

A step that raises without compile raises the same error, unchanged, with compile; the
function stays compiled (a later good call runs compiled), and nothing is reported as a
fallback. Only failures of the compiler stack fall back (tests/test_speedup.py injects those).
Whether a call ran compiled is read from inside it: ``torch.compiler.is_compiling()`` is
True while dynamo traces, and dynamo replays the list append with that value on every
compiled call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._functorch.config as functorch_config
from _custom_ops import custom_op
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import speedflags
from speedflags import CompileFallbackWarning, speedup

is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", torch._dynamo.is_compiling
)


@pytest.fixture(autouse=True)
def compiler_settings_untouched() -> Iterator[None]:
    yield
    assert torch._dynamo.config.suppress_errors is False
    assert getattr(functorch_config, "force_non_lazy_backward_lowering", False) is False


def counting_backend() -> Any:
    """A backend that runs each graph eagerly and counts the graphs it was given."""
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.append(len(calls) + 1)
        return gm.forward

    backend.calls = calls  # type: ignore[attr-defined]
    return backend


def eager_error(func: Callable[..., Any], *args: Any) -> BaseException:
    try:
        func(*args)
    except Exception as exc:
        return exc
    raise AssertionError("the step was expected to raise")


def assert_raises_unchanged(expected: BaseException, step: Callable[..., Any], *args: Any) -> None:
    """``step(*args)`` raises what the plain function raises, with no compiler error attached."""
    with pytest.raises(type(expected)) as raised:
        step(*args)
    assert type(raised.value) is type(expected)
    assert str(raised.value) == str(expected)
    assert raised.value.__cause__ is None and raised.value.__context__ is None


def assert_still_compiled(step: Any) -> None:
    assert step.stats.mode == "compiled" and step.stats.fallback_reason is None
    label = step.__wrapped__.__qualname__
    assert not [
        r for r in speedflags.ledger().history if r.lever == "compile" and label in (r.label or "")
    ]


A, BAD, GOOD = torch.ones(2, 3), torch.ones(4, 5), torch.ones(3, 5)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_a_shape_error_is_the_steps_own_and_the_step_stays_compiled(fullgraph: bool) -> None:
    # The issue: dynamo meets the mismatch first (its fake tensors fail), and that was taken
    # for a compiler failure: the step switched to eager for good, with a warning.
    # PyTorch 2.1 keys compiled code by the code object alone: without a reset, the other
    # parameter's `matmul` (the same code, compiled by another backend) would be reused.
    torch._dynamo.reset()
    backend = counting_backend()
    ran: list[bool] = []

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ran.append(is_compiling())
        return a @ b

    step = speedup(amp=False, compile={"backend": backend, "fullgraph": fullgraph})(matmul)
    expected = eager_error(matmul, A, BAD)
    for _ in range(2):  # every call, not only the first
        assert_raises_unchanged(expected, step, A, BAD)
        assert_still_compiled(step)
    ran.clear()
    torch.testing.assert_close(step(A, GOOD), A @ GOOD)
    assert ran == [True] and backend.calls  # the good call ran compiled
    assert_raises_unchanged(expected, step, A, BAD)
    ran.clear()
    step(A, GOOD)
    assert ran == [True]
    assert_still_compiled(step)


@pytest.mark.parametrize("compile", [True, {"fullgraph": True}], ids=["default", "fullgraph"])
def test_a_shape_error_under_inductor_is_the_steps_own(compile: Any) -> None:
    # compile=True as users write it: inductor (the lever is fixed so eager compares alike)
    ran: list[bool] = []

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ran.append(is_compiling())
        return a @ b

    step = speedup(amp=False, compile=compile)(matmul)
    expected = eager_error(matmul, A, BAD)
    assert_raises_unchanged(expected, step, A, BAD)
    assert_raises_unchanged(expected, step, A, BAD)
    assert_still_compiled(step)
    ran.clear()
    torch.testing.assert_close(step(A, GOOD), A @ GOOD)
    assert ran == [True]
    assert_still_compiled(step)


def test_an_error_after_a_graph_break_is_the_steps_own_and_nothing_runs_twice() -> None:
    # The frame that fails to trace starts after part of the call ran (the in-place update):
    # dynamo runs it eagerly, once, and its error is the step's.
    backend = counting_backend()
    state = torch.zeros(2)
    ran: list[bool] = []

    def train(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        state.add_(1)
        torch._dynamo.graph_break()
        ran.append(is_compiling())
        return a @ b

    step = speedup(amp=False, compile={"backend": backend})(train)
    expected = eager_error(train, A, BAD)
    state.zero_()
    assert_raises_unchanged(expected, step, A, BAD)
    torch.testing.assert_close(state, torch.ones(2))  # the first part ran once
    assert_still_compiled(step)
    ran.clear()
    torch.testing.assert_close(step(A, GOOD), A @ GOOD)
    assert ran == [True]  # the part after the break compiles again
    torch.testing.assert_close(state, torch.full((2,), 2.0))
    assert_still_compiled(step)


# A custom op whose real implementation checks values, which tracing (fake tensors) cannot:
# its error is raised by the compiled graph at run time, forward or backward.
def _nonnegative(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise ValueError("nonnegative: got a negative value")
    return x.clone()


def _nonnegative_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _nonnegative_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return nonnegative(grad)


nonnegative = custom_op("nonnegative", _nonnegative, _nonnegative_fake, _nonnegative_backward)


@pytest.mark.parametrize("lazy_backward", [False, True], ids=["backward-early", "backward-lazy"])
def test_an_error_the_compiled_graph_raises_at_run_time_is_the_steps_own(
    monkeypatch: pytest.MonkeyPatch, lazy_backward: bool
) -> None:
    if lazy_backward:
        # PyTorch 2.4 has no force_non_lazy_backward_lowering: the backward graph compiles
        # inside loss.backward(). Simulated here by not asking for the early compile.
        from speedflags._compile import backend as _compile_backend

        monkeypatch.setattr(_compile_backend, "early_backward_lowering", contextlib.nullcontext)
    elif not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        pytest.skip(f"PyTorch {torch.__version__} always compiles the backward lazily")
    early: list[bool] = []

    def backward_compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        early.append(getattr(functorch_config, "force_non_lazy_backward_lowering", False))
        return make_boxed_func(gm.forward)

    def forward_compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)

    def train(x: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        y = nonnegative(x * 2)
        (y * sign).sum().backward()
        return y.detach()

    step = speedup(amp=False, compile={"backend": backend})(train)

    def leaf(value: float) -> torch.Tensor:
        return torch.full((3,), value, requires_grad=True)

    plus, minus = torch.tensor(1.0), torch.tensor(-1.0)
    torch.testing.assert_close(step(leaf(1.0), plus), torch.full((3,), 2.0))
    assert early == [not lazy_backward]
    forward_error = eager_error(train, leaf(-1.0), plus)
    backward_error = eager_error(train, leaf(1.0), minus)  # the gradient is negative
    assert_raises_unchanged(forward_error, step, leaf(-1.0), plus)
    assert_raises_unchanged(backward_error, step, leaf(1.0), minus)
    assert_still_compiled(step)
    torch.testing.assert_close(step(leaf(1.0), plus), torch.full((3,), 2.0))
    assert len(early) == 1  # compiled once, never given up
    assert_still_compiled(step)


@pytest.mark.skipif(
    not hasattr(torch, "cond"), reason=f"PyTorch {torch.__version__}: no torch.cond"
)
def test_an_error_dynamo_does_not_suppress_before_the_step_ran_is_the_steps_own() -> None:
    # torch.cond's branches are traced as a whole: their error escapes dynamo's error
    # suppression. Nothing of the call ran, so it runs eagerly, and raises the eager error.
    ran: list[int] = []

    def branchy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return torch.cond(x.sum() > 0, lambda t: t @ w, lambda t: t @ w, (x,))  # type: ignore[attr-defined]

    step = speedup(amp=False, compile={"backend": "eager"})(branchy)
    expected = eager_error(branchy, A, BAD)
    ran.clear()
    with pytest.raises(type(expected)) as raised:
        step(A, BAD)
    assert str(raised.value).splitlines()[0] == str(expected).splitlines()[0]
    assert ran == [1]  # the eager run; tracing ran none of the body
    assert_still_compiled(step)
    torch.testing.assert_close(step(A, GOOD), A @ GOOD)
    assert_still_compiled(step)


@pytest.mark.skipif(not hasattr(torch, "cond"), reason=f"PyTorch {torch.__version__} has no cond")
def test_an_error_dynamo_does_not_suppress_after_part_of_the_step_ran_is_not_retried() -> None:
    # A graph break inside a cond branch escapes dynamo's error suppression, in the frame
    # after the break: the in-place update already ran. Whose error it is cannot be found
    # out without running that again, so it is not: the error propagates, the step falls
    # back (the documented limit).
    state = torch.zeros(2)

    def branch(t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return t * 2

    def branchy(x: torch.Tensor) -> torch.Tensor:
        state.add_(1)
        torch._dynamo.graph_break()
        return torch.cond(x.sum() > 0, branch, branch, (x,))  # type: ignore[attr-defined]

    step = speedup(amp=False, compile={"backend": "eager"})(branchy)
    with pytest.warns(CompileFallbackWarning, match="not retried"):
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            step(torch.ones(2))
    torch.testing.assert_close(state, torch.ones(2))  # once
    assert step.stats.mode == "fallback"


def _untraceable_fake(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected tracing failure")


untraceable = custom_op("untraceable", lambda x: x * 2, _untraceable_fake)


def test_a_compiler_failure_whose_frame_then_raises_is_reported_once_a_call_completes() -> None:
    # The frame dynamo could not trace (a fake implementation that raises) runs eagerly and
    # raises the step's own error: that call cannot tell which failed, so it blames the step.
    # The next call that completes shows the compiler failure, and falls back.
    @speedup(compile={"backend": "eager"})
    def step(x: torch.Tensor, fail: bool) -> torch.Tensor:
        y = untraceable(x)
        if fail:
            raise ValueError("the step's own error")
        return y

    with pytest.raises(ValueError, match="the step's own error"):
        step(torch.ones(2), True)
    assert_still_compiled(step)
    with pytest.warns(CompileFallbackWarning, match="injected tracing failure"):
        torch.testing.assert_close(step(torch.ones(2), False), torch.full((2,), 2.0))
    assert step.stats.mode == "fallback"
