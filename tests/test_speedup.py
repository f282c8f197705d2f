"""@speedup: levers per call, torch.compile with a fallback that never breaks a step.

Compile failures are injected deterministically: custom backends that raise on a chosen
graph or in the backward compiler, a custom op whose fake (tracing) implementation raises,
and ``fullgraph=True`` on a function with a graph break. The ``eager``/``aot_eager`` and
custom backends keep the suite fast; inductor runs once, for the transformer test, because
that test is about what ``compile=True`` really does.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._functorch.config as functorch_config
from _custom_ops import custom_op
from conftest import autocast_dtype, autocast_enabled, last_seq, records_since
from torch._dynamo.backends.common import aot_autograd

import speedflags
from speedflags import CompileFallbackWarning, InvalidTypeError, InvalidValueError, speedup


@pytest.fixture(autouse=True)
def compiler_settings_untouched() -> Iterator[None]:
    """No test may leave a dynamo/functorch setting changed (speedup scopes them per call)."""
    yield
    assert torch._dynamo.config.suppress_errors is False
    assert getattr(functorch_config, "force_non_lazy_backward_lowering", False) is False


EAGER_BACKWARD = hasattr(functorch_config, "force_non_lazy_backward_lowering")


def _dynamo_config_is_thread_local() -> bool:
    # Feature probe, not a version check: is a patched setting invisible to another thread?
    seen: list[bool] = []
    with torch._dynamo.config.patch(suppress_errors=True):
        other = threading.Thread(target=lambda: seen.append(torch._dynamo.config.suppress_errors))
        other.start()
        other.join(30)
    return seen == [False]


DYNAMO_CONFIG_THREAD_LOCAL = _dynamo_config_is_thread_local()


def counting_backend(fail_on: Callable[[int], bool] = lambda n: False) -> Any:
    """A backend that runs each graph eagerly, counts graphs, and raises where told."""
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.append(len(calls) + 1)
        if fail_on(len(calls)):
            raise RuntimeError(f"injected failure on graph {len(calls)}")
        return gm.forward

    backend.calls = calls  # type: ignore[attr-defined]
    return backend


def compile_records() -> list:
    return [r for r in speedflags.ledger().history if r.lever == "compile"]


# --- levers per call (behaviour 1) --------------------------------------------------------


def test_bf16_autocast_inside_and_snapshot_unchanged_after_every_call() -> None:
    @speedup(amp="bf16", device="cpu")
    def step(x: torch.Tensor) -> tuple:
        return (x @ x).dtype, autocast_enabled("cpu"), autocast_dtype("cpu")

    before = speedflags.snapshot()
    for _ in range(3):
        assert step(torch.ones(2, 2)) == (torch.bfloat16, True, torch.bfloat16)
        assert speedflags.snapshot() == before
    assert step.stats.calls == 3
    assert step.stats.levers == {"amp": "bfloat16"}


def test_snapshot_unchanged_when_the_step_raises() -> None:
    @speedup(amp="bf16", device="cpu", cudnn_benchmark=True)
    def step() -> None:
        assert autocast_enabled("cpu") and torch.backends.cudnn.benchmark
        raise KeyError("inside the step")

    before = speedflags.snapshot()
    with pytest.raises(KeyError, match="inside the step"):
        step()
    assert speedflags.snapshot() == before


def test_bare_speedup_applies_the_recommended_levers() -> None:
    @speedup
    def step() -> dict:
        return speedflags.snapshot()

    inside = step()
    rec = speedflags.recommended()  # for the default device: a GPU where there is one
    device_type = torch.device(rec.device).type
    assert inside["amp"][device_type]["enabled"] is (rec.levers.get("amp") is not None)
    assert step.stats.levers == {
        name: ("bfloat16" if value == "bf16" else value) for name, value in rec.levers.items()
    }
    labels = {r.label for r in speedflags.ledger().history[-4:]}
    assert any(label.endswith("step: speedup()") for label in labels)


def test_metadata_and_wrapped_are_kept() -> None:
    def step(x: int) -> int:
        """Doc of step."""
        return x + 1

    decorated = speedup(cudnn_benchmark=True)(step)
    assert decorated.__name__ == "step" and decorated.__doc__ == "Doc of step."
    assert decorated.__wrapped__ is step
    assert decorated(1) == 2


class Trainer:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.seen: list[bool] = []

    @speedup(cudnn_benchmark=True)
    def step(self, x: int) -> float:
        self.seen.append(torch.backends.cudnn.benchmark)
        return x * self.scale

    @speedup(compile={"backend": "eager"})
    def compiled_step(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    @staticmethod
    @speedup(cudnn_benchmark=True)
    def static() -> bool:
        return bool(torch.backends.cudnn.benchmark)

    @speedup(cudnn_benchmark=True)
    @classmethod
    def klass(cls) -> tuple:
        return cls, bool(torch.backends.cudnn.benchmark)


def test_methods_bind_self_staticmethod_and_classmethod() -> None:
    a, b = Trainer(2.0), Trainer(3.0)
    assert a.step(1) == 2.0 and b.step(1) == 3.0
    assert a.seen == [True] and b.seen == [True]
    assert Trainer.static() is True
    assert Trainer.klass() == (Trainer, True)
    assert a.step.stats is b.step.stats is Trainer.step.stats
    assert Trainer.step.stats.calls == 2
    assert not torch.backends.cudnn.benchmark


def test_one_compiled_artefact_per_function_not_per_call_or_instance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a spy around the real torch.compile: how many artefacts speedup builds
    built: list[Any] = []
    real_compile = torch.compile

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(args[0])
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    a, b = Trainer(2.0), Trainer(3.0)
    assert built == []  # lazily, at the first call
    for _ in range(3):
        torch.testing.assert_close(a.compiled_step(torch.ones(2)), torch.full((2,), 2.0))
        torch.testing.assert_close(b.compiled_step(torch.ones(2)), torch.full((2,), 3.0))
    assert built == [Trainer.compiled_step.__wrapped__]
    assert Trainer.compiled_step.stats.mode == "compiled"


def test_decorating_a_class_is_refused() -> None:
    with pytest.raises(InvalidTypeError, match="speedup cannot decorate the class 'Trainer'"):
        speedup(tf32=True)(Trainer)


def test_generator_gets_levers_and_inference_mode_per_step() -> None:
    @speedup(cudnn_benchmark=True, inference=True)
    def gen() -> Iterator[tuple]:
        yield torch.backends.cudnn.benchmark, torch.is_inference_mode_enabled()
        yield torch.backends.cudnn.benchmark, torch.is_inference_mode_enabled()

    g = gen()
    assert next(g) == (True, True)
    assert (torch.backends.cudnn.benchmark, torch.is_inference_mode_enabled()) == (False, False)
    assert next(g) == (True, True)
    assert gen.stats.calls == 2  # steps, for a generator


def test_compile_refuses_generator_functions() -> None:
    def gen() -> Iterator[int]:
        yield 1

    with pytest.raises(InvalidTypeError, match=r"cannot compile 'test_compile_refuses.*gen'"):
        speedup(compile=True)(gen)


def test_inference_mode_for_each_call() -> None:
    model = torch.nn.Linear(3, 2)

    @speedup(inference=True)
    def evaluate(x: torch.Tensor) -> torch.Tensor:
        assert torch.is_inference_mode_enabled()
        return model(x)

    out = evaluate(torch.ones(1, 3))
    assert out.is_inference() and not out.requires_grad
    assert not torch.is_inference_mode_enabled()
    assert evaluate.stats.inference is True


# --- validation at decoration -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"compile": "yes"},
            InvalidTypeError,
            "speedup(compile='yes'): expected True, False or a dict of torch.compile options, "
            "got str",
        ),
        (
            {"compile": {"fullgrpah": True}},
            InvalidValueError,
            "speedup(compile={'fullgrpah': True}): unknown torch.compile option 'fullgrpah'; "
            "valid: ",
        ),
        (
            {"compile": {"fullgraph": "yes"}},
            InvalidTypeError,
            "speedup(compile={'fullgraph': 'yes'}): 'fullgraph' must be True or False, got str",
        ),
        (
            {"compile": {"mode": "max-autotune", "options": {}}},
            InvalidValueError,
            "speedup(compile={'mode': 'max-autotune', 'options': {}}): torch.compile takes "
            "'mode' or 'options', not both",
        ),
        (
            {"compile": {"backend": "indutor"}},
            InvalidValueError,
            "speedup(compile={'backend': 'indutor'}): torch.compile has no backend 'indutor'; "
            "registered: ",
        ),
        (
            {"inference": "yes"},
            InvalidTypeError,
            "speedup(inference='yes'): expected True or False, got str",
        ),
        ({"amp": "bf17"}, InvalidValueError, "speedup(amp='bf17'): not an autocast dtype"),
        ({"tf32": "on"}, InvalidTypeError, "speedup(tf32='on'): "),
    ],
)
def test_bad_arguments_fail_at_decoration(kwargs: dict, error: type, message: str) -> None:
    before = speedflags.snapshot()
    with pytest.raises(error) as excinfo:
        speedup(**kwargs)
    assert str(excinfo.value).startswith(message)
    assert speedflags.snapshot() == before


# --- compile succeeds (behaviour 3) -------------------------------------------------------


def test_a_step_that_compiles_runs_compiled_and_matches_eager() -> None:
    backend = counting_backend()
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight).sum(dim=1)

    step = speedup(amp="bf16", device="cpu", compile={"backend": backend})(forward)
    assert step.stats.mode == "pending"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        out = step(x)
    assert step.stats.compiled and step.stats.mode == "compiled"
    assert step.stats.fallback_reason is None
    assert backend.calls == [1]  # compiled once, reused
    with speedflags.fast_math(amp="bf16", device="cpu"):
        expected = forward(x)
    torch.testing.assert_close(out, expected)  # same graph, same dtype
    torch.testing.assert_close(out.float(), forward(x), rtol=2e-2, atol=2e-2)  # bf16 vs fp32


def _compile_recording_its_arguments(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    # What Lightning does to torch.compile once imported (lightning/fabric/wrappers.py,
    # _capture_compile_kwargs), reproduced so the test does not depend on Lightning: a module
    # compiled gets a deep copy of compile's keyword arguments, the backend among them.
    import copy

    @functools.wraps(compile_fn)
    def capture(*args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.nn.Module):
            return compile_fn(*args, **kwargs)
        compiled = compile_fn(args[0], **kwargs)
        compiled._compile_kwargs = copy.deepcopy(kwargs)
        return compiled

    return capture


def test_a_module_compiles_where_torch_compile_deep_copies_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Failed before: with Lightning imported, @speedup(compile=True) on a module and
    # guard_levers fell back to eager ("cannot pickle '_thread.RLock' object": the backend
    # holds the step's locks).
    monkeypatch.setattr(torch, "compile", _compile_recording_its_arguments(torch.compile))
    net = torch.nn.Linear(4, 4)
    step = speedup(amp=False, device="cpu", compile={"backend": "eager"})(net)
    x = torch.ones(2, 4)
    torch.testing.assert_close(step(x), net(x))
    assert step.stats.mode == "compiled", step.stats.fallback_reason
    guarded = speedflags.guard_levers(torch.nn.Linear(4, 4), backend="eager")
    assert guarded._compile_kwargs["backend"] is guarded._compile_kwargs["backend"]
    guarded(x)


# --- compile fails: the step completes, nothing twice, one warning (behaviour 2) -----------


def test_fullgraph_with_a_graph_break_runs_eagerly_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = [0]

    @speedup(compile={"fullgraph": True, "backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    with caplog.at_level(logging.WARNING, logger="speedflags"):
        with pytest.warns(CompileFallbackWarning, match="torch.compile failed") as warned:
            first = step(torch.ones(3))
        torch.testing.assert_close(first, torch.full((3,), 3.0))
        assert counter == [1]
        for calls in (2, 3):
            torch.testing.assert_close(step(torch.ones(3)), torch.full((3,), 3.0))
            assert counter == [calls]
    # PyTorch 2.1 may warn too: "changing options to `torch.compile()` may require calling
    # `torch._dynamo.reset()`", when the previous compiled call had another backend
    reset_hint = "may require calling `torch._dynamo.reset()`"
    others = [w.category for w in warned if reset_hint not in str(w.message)]
    assert others == [CompileFallbackWarning]
    assert [r.name for r in caplog.records if r.name == "speedflags"] == ["speedflags"]
    assert step.stats.mode == "fallback" and not step.stats.compiled
    assert step.stats.fallback_reason.startswith("Unsupported")
    (record,) = compile_records()[-1:]
    assert (record.action, record.after) == ("fallback", "eager")
    assert record.reason == step.stats.fallback_reason
    assert record.where.endswith("test_speedup.py:" + str(record.where.rsplit(":", 1)[1]))


def test_backend_failing_on_the_first_graph() -> None:
    backend = counting_backend(fail_on=lambda n: True)
    counter = [0]

    @speedup(compile={"backend": backend})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return x.sin() + 1

    with pytest.warns(CompileFallbackWarning, match="injected failure on graph 1"):
        torch.testing.assert_close(step(torch.zeros(2)), torch.ones(2))
    torch.testing.assert_close(step(torch.zeros(2)), torch.ones(2))
    assert counter == [2]
    assert backend.calls == [1]  # later calls do not retry


def test_backend_failing_on_the_second_graph_runs_nothing_twice() -> None:
    # speedflags/_compile/guarded.py: the second graph fails after the first one ran; a plain retry
    # would repeat the first graph's side effects (the in-place update and the counter).
    backend = counting_backend(fail_on=lambda n: n == 2)
    counter = [0]
    state = torch.zeros(3)

    @speedup(compile={"backend": backend})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        state.add_(x)  # an in-place update in the first graph
        torch._dynamo.graph_break()
        return state * 2

    with pytest.warns(CompileFallbackWarning, match="injected failure on graph 2"):
        out = step(torch.ones(3))
    assert counter == [1]
    torch.testing.assert_close(state, torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    step(torch.ones(3))
    assert counter == [2]
    torch.testing.assert_close(state, torch.full((3,), 2.0))
    assert backend.calls == [1, 2]


def test_failure_at_a_later_recompile() -> None:
    backend = counting_backend(fail_on=lambda n: n == 2)
    counter = [0]

    @speedup(compile={"backend": backend, "dynamic": False})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return x * 2

    torch.testing.assert_close(step(torch.ones(2)), torch.full((2,), 2.0))
    assert step.stats.mode == "compiled"
    with pytest.warns(CompileFallbackWarning, match="injected failure on graph 2"):
        torch.testing.assert_close(step(torch.ones(5)), torch.full((5,), 2.0))  # new shape
    torch.testing.assert_close(step(torch.ones(7)), torch.full((7,), 2.0))
    assert counter == [3]
    assert backend.calls == [1, 2]
    assert step.stats.mode == "fallback"


@pytest.mark.skipif(
    not EAGER_BACKWARD,
    reason=f"PyTorch {torch.__version__} has no force_non_lazy_backward_lowering: it compiles "
    "the backward lazily (see the test below)",
)
def test_backward_compile_failure_is_caught_before_the_step_runs_anything_twice() -> None:
    # speedflags/_compile/guarded.py: AOT autograd compiles the backward lazily inside
    # loss.backward(), after the forward's side effects; speedup moves that compile next to
    # the forward's.
    flags_seen: list[bool] = []

    def fw(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        flags_seen.append(functorch_config.force_non_lazy_backward_lowering)
        return gm.forward

    def bw(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        raise RuntimeError("injected backward compile failure")

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    counter = [0]

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)
    step = speedup(amp=False, compile={"backend": backend})(train)  # fp32, as the reference
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    with pytest.warns(CompileFallbackWarning, match="injected backward compile failure"):
        loss = step(model, opt, x)
    assert counter == [1]  # not retried
    assert flags_seen and all(flags_seen)  # set while the backend ran (every graph) ...
    assert functorch_config.force_non_lazy_backward_lowering is False  # ... and only then
    ref_loss = train(reference, ref_opt, x)  # one eager step: same loss, same weights
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(model.weight, reference.weight)
    step(model, opt, x)
    train(reference, ref_opt, x)
    torch.testing.assert_close(model.weight, reference.weight)
    assert step.stats.mode == "fallback"


def _twice_fake(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected tracing failure")


twice = custom_op("twice", lambda x: x * 2, _twice_fake)


def test_tracing_error_after_a_graph_break_runs_that_frame_eagerly() -> None:
    # Not a graph break: a hard dynamo error in the frame resumed after the break. Without
    # speedup, dynamo raises it after the first graph ran; with it, that frame runs eagerly.
    counter = [0]
    state = torch.zeros(2)

    @speedup(compile={"backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        state.add_(1)
        torch._dynamo.graph_break()
        return twice(x + state)

    with pytest.warns(CompileFallbackWarning, match="injected tracing failure"):
        out = step(torch.ones(2))  # (2.4 reports it on the line after "Failed running ...:")
    torch.testing.assert_close(out, torch.full((2,), 4.0))
    assert counter == [1]
    torch.testing.assert_close(state, torch.ones(2))
    assert step.stats.fallback_reason.startswith("dynamo could not compile a frame")


@pytest.mark.skipif(
    not hasattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis"),
    reason=f"PyTorch {torch.__version__}'s backends do not ask dynamo to re-trace "
    "(no TensorifyScalarRestartAnalysis)",
)
def test_dynamo_restart_signals_from_the_backend_are_not_failures() -> None:
    # Inductor raises TensorifyScalarRestartAnalysis to make dynamo re-trace a graph; the
    # guarded backend must let it through (found by the transformer test below).
    def restart_once(n: int) -> bool:
        if n == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis
        return False

    backend = counting_backend(fail_on=restart_once)

    @speedup(compile={"backend": backend})
    def step(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    torch.testing.assert_close(step(torch.ones(2), 3.0), torch.full((2,), 3.0))
    assert step.stats.mode == "compiled"
    assert len(backend.calls) == 2  # re-traced, then compiled


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_suppress_errors_is_scoped_to_the_call_and_thread() -> None:
    seen: dict = {}

    @speedup(compile={"backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        seen["here"] = torch._dynamo.config.suppress_errors
        other = threading.Thread(
            target=lambda: seen.__setitem__("other", torch._dynamo.config.suppress_errors)
        )
        other.start()
        other.join(30)
        return x + 1

    speedup(compile={"backend": "eager"})  # decoration alone sets nothing
    assert torch._dynamo.config.suppress_errors is False
    step.__wrapped__(torch.ones(1))  # eager: records what the body sees without speedup
    assert seen == {"here": False, "other": False}
    step(torch.ones(1))
    # the compiled body ran (dynamo traced and replayed it); where dynamo's config is
    # thread-local the setting is on in this thread only, and it never outlives the call
    assert seen["other"] is not DYNAMO_CONFIG_THREAD_LOCAL
    assert torch._dynamo.config.suppress_errors is False


def test_errors_of_the_step_itself_propagate_and_keep_compiling() -> None:
    @speedup(compile={"backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            raise ValueError("the step's own error")
        return x

    with pytest.raises(ValueError, match="the step's own error"):
        step(torch.ones(2))
    assert step.stats.mode == "compiled" and step.stats.fallback_reason is None
    assert not [r for r in compile_records() if "test_errors_of_the_step_itself" in r.label]


def test_fullgraph_step_error_is_raised_by_the_eager_run_and_not_a_fallback() -> None:
    counter = [0]

    @speedup(compile={"fullgraph": True, "backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return x @ torch.ones(5, 5)  # a shape error: tracing fails, so does eager

    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied|size mismatch"):
        step(torch.ones(2, 3))
    assert counter == [1]  # the eager run, once; tracing ran none of the body
    assert step.stats.mode == "compiled"


def test_no_torch_compile_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch 2.13 has torch.compile; a build without it can only be simulated.
    monkeypatch.delattr(torch, "compile")

    @speedup(compile=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with pytest.warns(CompileFallbackWarning, match="has no torch.compile"):
        torch.testing.assert_close(step(torch.ones(1)), torch.full((1,), 2.0))
    assert step.stats.mode == "fallback"


def test_torch_compile_refusing_the_platform_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # What torch.compile raises on an unsupported Python, simulated on this one.
    @functools.wraps(torch.compile)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torch.compile is not supported on Python 3.15+")

    monkeypatch.setattr(torch, "compile", refuse)

    @speedup(compile={"backend": "eager"})
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with pytest.warns(CompileFallbackWarning, match=r"not supported on Python 3\.15\+"):
        step(torch.ones(1))
    step(torch.ones(1))
    assert step.stats.fallback_reason.startswith("torch.compile cannot be set up here")


def test_bad_inductor_mode_falls_back_at_the_first_call() -> None:
    @speedup(compile={"mode": "fastest-please"})
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with pytest.warns(CompileFallbackWarning, match="fastest-please"):
        torch.testing.assert_close(step(torch.ones(1)), torch.full((1,), 2.0))


# --- a real model (behaviour 6) -----------------------------------------------------------


def _transformer(seed: int) -> tuple:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    head = torch.nn.Linear(64, 16)
    return encoder, head


def _train(step: Callable[..., torch.Tensor], batches: list) -> list[float]:
    return [float(step(x, y)) for x, y in batches]


def test_small_transformer_bf16_compiled_matches_fp32_eager() -> None:
    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(8, 16, 64, generator=gen), torch.randint(0, 16, (8, 16), generator=gen))
        for _ in range(5)
    ]

    def make_step() -> Callable[..., torch.Tensor]:
        encoder, head = _transformer(seed=0)
        params = list(encoder.parameters()) + list(head.parameters())
        opt = torch.optim.SGD(params, lr=0.05)

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = head(encoder(x))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return train_step

    fp32 = _train(make_step(), batches)
    fast_step = speedup(amp="bf16", device="cpu", compile=True)(make_step())  # inductor
    fast = _train(fast_step, batches)
    assert fast_step.stats.mode == "compiled", fast_step.stats.fallback_reason
    assert fp32[-1] < fp32[0]  # it trains
    for a, b in zip(fast, fp32, strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (fast, fp32)  # bf16: 8 mantissa bits


def test_check_ranks_is_validated_and_passed_to_the_frame() -> None:
    with pytest.raises(speedflags.InvalidTypeError, match=r"speedup\(check_ranks='yes'\)"):
        speedflags.speedup(check_ranks="yes")  # type: ignore[arg-type]
    start = last_seq()

    @speedflags.speedup(cudnn_benchmark=True, check_ranks=True)
    def step() -> bool:
        return bool(torch.backends.cudnn.benchmark)

    assert step() is True
    assert step() is True
    # without a process group nothing is compared, and the ledger says so once
    notes = [r for r in records_since(start) if r.lever == "ranks"]
    assert len(notes) == 1
    assert "no torch.distributed process group" in notes[0].reason
    assert "check_ranks=True" in notes[0].label


@pytest.mark.skipif(
    EAGER_BACKWARD,
    reason=f"PyTorch {torch.__version__} compiles the backward early when asked (test above)",
)
def test_lazy_backward_compile_failure_raises_once_then_runs_eagerly() -> None:
    # PyTorch 2.4: the backward graph compiles inside loss.backward(), after the forward's
    # side effects, and nothing can move it. That step raises; it must be recognised as a
    # compile failure so that later steps run eagerly rather than fail forever.
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return gm.forward

    def bw(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        raise RuntimeError("injected backward compile failure")

    model = torch.nn.Linear(4, 1)
    counter = [0]

    def train(x: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss.detach()

    step = speedup(amp=False, compile={"backend": aot_autograd(fw_compiler=fw, bw_compiler=bw)})(
        train
    )
    x = torch.randn(8, 4)
    with pytest.warns(CompileFallbackWarning, match="compiles the backward graph lazily"):
        with pytest.raises(RuntimeError, match="injected backward compile failure"):
            step(x)
    assert step.stats.mode == "fallback"
    assert "backward graph failed to compile" in (step.stats.fallback_reason or "")
    step(x)  # eager now: completes
    assert counter == [2]
