"""Compiled code never runs a graph traced under another state of a lever dynamo does not guard.

``@speedup(compile=...)`` and ``speedflags.guard_levers`` read the SDPA kernels and order,
cuDNN's flags, oneDNN's precision and the reduced-precision reductions before each call
(``docs/compile.md``). Which SDPA kernel ran is read from the profiler; its name differs:
``aten::_scaled_dot_product_flash_attention`` on PyTorch 2.1, ``..._for_cpu`` from 2.2.
Levers that cannot change a CPU graph (cuDNN's, fp16 accumulation) are checked by the
compiles they cause: on a CPU the graph is the same, so a wrong reuse could not be seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import speedflags
from speedflags import CompileFallbackWarning, InvalidTypeError, InvalidValueError, speedup
from speedflags._compile import lever_guard
from speedflags._compile.lever_guard import PER_STATE, RECOMPILE, guard_mode, state_tag
from speedflags._compile.lever_state import lever_state, unguarded
from speedflags.levers.registry import REGISTRY

MODE = guard_mode()
# the CPU flash kernel's name: "_for_cpu" from PyTorch 2.2 (2.1 has one name for every device)
FLASH = (
    "aten::_scaled_dot_product_flash_attention_for_cpu"
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    else "aten::_scaled_dot_product_flash_attention"
)
# One head: PyTorch 2.1's inductor fails a stride assert on the CPU flash kernel's output for
# two heads and more (its bug; eager and aot_eager are fine).
Q = torch.randn(1, 1, 8, 8)
HAS_CACHE_TAG = hasattr(getattr(torch.compiler, "config", None), "cache_key_tag")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sdpa_ops(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The SDPA kernels one call ran (traced ones included, on a call that compiles)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q) * 2


class BrokenAttention(torch.nn.Module):
    """Attention after a graph break, in a callee: compiled as frames of its own."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = q * 1.5
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(q, q, q)


def check_flash_then_math(
    step: Callable[..., Any], rounds: int = 2, levers: Callable[..., Any] = speedflags.sdpa_backend
) -> None:
    """flash, math, flash, math...: the math calls never run the flash kernel."""
    for _ in range(rounds):
        with levers("flash"):
            step(Q)  # compiles at the first round
            assert FLASH in sdpa_ops(step, Q)
        with levers("math"):
            assert FLASH not in sdpa_ops(step, Q)  # the call that compiles, or not
            assert FLASH not in sdpa_ops(step, Q)


def expected_graphs(states: int, switches: int, per_call: int = 1) -> int:
    """Graphs compiled: once per state (per_state), or again after each switch (recompile)."""
    return per_call * (states if MODE == PER_STATE else switches + 1)


# --- which levers, and what dynamo does with them ---------------------------------------------


def test_the_unguarded_levers_come_from_the_registry() -> None:
    assert [s.name for s in unguarded()] == [s.name for s in REGISTRY if s.dynamo_misses]
    # every process-wide lever has a part dynamo misses on some version; autocast is guarded
    assert {s.name for s in unguarded()} == {s.name for s in REGISTRY if s.scope == "process"}
    assert "amp" not in {s.name for s in unguarded()}


# a value of each unguarded lever that changes its state from PyTorch's defaults
CHANGES = {
    "tf32": True,
    "matmul_precision": "medium",
    "cudnn_benchmark": True,
    "sdpa": "math",
    "deterministic": True,
    "reduced_precision_reduction": False,
}


@pytest.mark.parametrize("name", [s.name for s in unguarded()])
def test_the_state_read_changes_with_each_unguarded_lever(name: str) -> None:
    before = lever_state()
    with speedflags.fast_math(device="cpu", **{name: CHANGES[name]}):  # type: ignore[arg-type]
        inside = lever_state()
    assert inside != before
    assert lever_state() == before
    assert state_tag(inside) != state_tag(before) and state_tag(before) == state_tag(before)


def test_plain_torch_compile_serves_the_flash_graph_under_math() -> None:
    # PyTorch's gap, which the rest of this file closes: if this fails, dynamo now guards the
    # SDPA flags, and docs/compile.md and the registry's dynamo_misses must say so.
    compiled = torch.compile(attention, backend="aot_eager")
    with speedflags.sdpa_backend("flash"):
        compiled(Q)
    with speedflags.sdpa_backend("math"):
        assert FLASH in sdpa_ops(compiled, Q)


def test_a_guard_on_the_outer_frame_misses_a_callee_after_a_graph_break() -> None:
    # Why every frame is keyed (per-state backends, or forgetting every frame): dynamo guards
    # the globals a traced frame reads, but the callee's frames after its graph break read
    # none of them, so their graph traced under flash is served under math.
    model = BrokenAttention()
    key = {"sdpa": "flash"}

    def outer(q: torch.Tensor) -> torch.Tensor:
        if key["sdpa"] == "flash":  # guarded: dynamo re-traces this frame when it changes
            q = q + 0
        return model(q)

    compiled = torch.compile(outer, backend="aot_eager")
    with speedflags.sdpa_backend("flash"):
        compiled(Q)
    key["sdpa"] = "math"
    with speedflags.sdpa_backend("math"):
        assert FLASH in sdpa_ops(compiled, Q)


# --- @speedup(compile=...) ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_speedup_runs_the_math_kernel_after_flash(backend: str) -> None:
    # the case: the step called inside fast_math(sdpa="flash"), then sdpa="math"
    step = speedup(compile={"backend": backend}, amp=False)(attention)
    start = graphs()
    check_flash_then_math(step, levers=lambda kernel: speedflags.fast_math(sdpa=kernel))
    assert graphs() - start == expected_graphs(states=2, switches=3)
    guard = step.stats.lever_guard
    assert (guard.mode, guard.states, guard.calls) == (MODE, 2, 8)
    assert guard.recompiles == (1 if MODE == PER_STATE else 3)
    assert step.stats.mode == "compiled"
    assert step.stats.to_dict()["lever_guard"] == guard.to_dict()


def test_speedup_with_a_graph_break_in_a_callee() -> None:
    model = BrokenAttention()
    step = speedup(compile={"backend": "aot_eager"}, amp=False)(lambda q: model(q) + 1)
    start = graphs()
    check_flash_then_math(step)
    # three graphs per state: the callee's before and after its break, and the `+ 1`
    assert graphs() - start == expected_graphs(states=2, switches=3, per_call=3)


def test_speedup_without_compile_has_no_lever_guard() -> None:
    step = speedup(amp=False)(attention)
    step(Q)
    assert step.stats.lever_guard is None and step.stats.to_dict()["lever_guard"] is None


@pytest.mark.parametrize(
    "change",
    [
        {"cudnn_benchmark": True},
        {"deterministic": "warn"},
        {"tf32": True},
        {"matmul_precision": "medium"},
        {"reduced_precision_reduction": False},
    ],
    ids=lambda c: next(iter(c)),
)
def test_levers_that_cannot_change_a_cpu_graph_still_compile_apart(change: dict[str, Any]) -> None:
    # On a CPU these flags leave the graph as it was (cuDNN, cuBLAS) or, on a CPU without AMX,
    # oneDNN's kernels unchanged: what is checked is that the step compiled for the state.
    step = speedup(compile={"backend": "aot_eager"}, amp=False)(lambda x: x @ x + 1)
    x = torch.ones(4, 4)
    start = graphs()
    step(x)
    with speedflags.fast_math(device="cpu", **change):
        torch.testing.assert_close(step(x), x @ x + 1)
    step(x)
    assert graphs() - start == expected_graphs(states=2, switches=2)
    assert step.stats.lever_guard.states == 2


def test_the_step_own_levers_are_part_of_the_state() -> None:
    # two steps that differ only in their sdpa lever share the function's code objects
    flash = speedup(compile={"backend": "aot_eager"}, amp=False, sdpa="flash")(attention)
    math = speedup(compile={"backend": "aot_eager"}, amp=False, sdpa="math")(attention)
    flash(Q)
    math(Q)
    assert FLASH in sdpa_ops(flash, Q)
    assert FLASH not in sdpa_ops(math, Q)


def test_frames_compiled_elsewhere_under_another_state_are_not_served() -> None:
    # a plain torch.compile of the same model compiled its frames under flash first
    model = BrokenAttention()
    with speedflags.sdpa_backend("flash"):
        torch.compile(model, backend="aot_eager")(Q)
    step = speedup(compile={"backend": "aot_eager"}, amp=False)(lambda q: model(q))
    with speedflags.sdpa_backend("math"):
        assert FLASH not in sdpa_ops(step, Q)
        assert FLASH not in sdpa_ops(step, Q)


def _limit_name() -> str:
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@pytest.mark.parametrize("fullgraph", [False, True])
def test_more_states_than_dynamo_keeps(fullgraph: bool, caplog: pytest.LogCaptureFixture) -> None:
    step = speedup(compile={"backend": "aot_eager", "fullgraph": fullgraph}, amp=False)(attention)
    states = ["flash", "math", "efficient"]
    with torch._dynamo.config.patch(**{_limit_name(): 2}):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for state in states:
                with speedflags.sdpa_backend(state):
                    torch.testing.assert_close(step(Q), attention(Q))
                    ran = sdpa_ops(step, Q)
                    assert (FLASH in ran) == (state == "flash")
    fallbacks = [w for w in warned if issubclass(w.category, CompileFallbackWarning)]
    if MODE == RECOMPILE:  # each change empties the cache: the limit is never reached
        assert fallbacks == [] and step.stats.mode == "compiled"
    elif fullgraph:  # dynamo raises at the limit: the step falls back to eager, once
        assert len(fallbacks) == 1 and step.stats.mode == "fallback"
        assert "limit" in (step.stats.fallback_reason or "").lower()
    else:  # dynamo warns and runs the frame eagerly, with the levers in force
        assert fallbacks == [] and step.stats.mode == "compiled"
        assert any("limit" in r.getMessage() for r in caplog.records)


# --- speedflags.guard_levers ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_guard_levers_function_runs_the_math_kernel_after_flash(backend: str) -> None:
    guarded = speedflags.guard_levers(attention, backend=backend)
    start = graphs()
    check_flash_then_math(guarded)
    assert graphs() - start == expected_graphs(states=2, switches=3)
    assert (guarded.stats.mode, guarded.stats.states) == (MODE, 2)  # type: ignore[attr-defined]
    assert guarded.__wrapped__ is attention  # type: ignore[attr-defined]


def test_guard_levers_module_with_a_graph_break() -> None:
    model = BrokenAttention()
    guarded = speedflags.guard_levers(model, backend="aot_eager")
    assert isinstance(guarded, torch.nn.Module) and type(guarded).__name__ == "OptimizedModule"
    check_flash_then_math(guarded)
    assert guarded.forward.stats.states == 2  # type: ignore[attr-defined]
    # the module torch.compile would have returned: same parameters, modes and state dict
    guarded.eval()
    assert not model.training
    assert list(guarded.state_dict()) == list(torch.compile(model).state_dict())


def test_guard_levers_module_outputs_match_eager() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    guarded = speedflags.guard_levers(model, backend="aot_eager")
    x = torch.randn(2, 8)
    for flag in (False, True, False):
        with speedflags.cudnn_benchmark(flag):
            torch.testing.assert_close(guarded(x), model(x))
    assert guarded.forward.stats.states == 2  # type: ignore[attr-defined]


def test_guard_levers_called_from_compiled_code_is_inlined() -> None:
    guarded = speedflags.guard_levers(attention, backend="aot_eager")
    outer = torch.compile(lambda q: guarded(q) + 1, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(outer(Q), attention(Q) + 1)
    assert guarded.stats.calls == 0  # type: ignore[attr-defined]  # traced, not called


def test_guard_levers_disabled_returns_the_model_as_torch_compile_does() -> None:
    model = torch.nn.Linear(2, 2)
    assert speedflags.guard_levers(model, disable=True) is model
    assert speedflags.guard_levers(attention, disable=True) is attention
    assert "forward" not in vars(model)  # its forward left alone


def test_guard_levers_refuses_what_torch_compile_returned() -> None:
    for compiled in (torch.compile(attention), torch.compile(torch.nn.Linear(2, 2))):
        with pytest.raises(InvalidTypeError, match=r"got what torch\.compile returned"):
            speedflags.guard_levers(compiled)


def test_guard_levers_refuses_bad_input() -> None:
    with pytest.raises(InvalidTypeError, match=r"guard_levers\(3\): expected an nn.Module"):
        speedflags.guard_levers(3)  # type: ignore[type-var]
    with pytest.raises(InvalidValueError, match=r"unknown torch.compile option 'fullgrph'"):
        speedflags.guard_levers(attention, fullgrph=True)
    with pytest.raises(InvalidValueError, match="has no backend 'nope'"):
        speedflags.guard_levers(attention, backend="nope")


# --- inductor's caches --------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CACHE_TAG, reason=f"PyTorch {torch.__version__}: no cache_key_tag")
def test_the_state_is_in_the_cache_key_while_a_graph_compiles() -> None:
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    torch.compiler.config.cache_key_tag = "mine"
    try:
        guarded = speedflags.guard_levers(attention, backend=backend)
        with speedflags.sdpa_backend("math"):
            guarded(Q)
            tag = state_tag(lever_state())
        assert seen == [f"mine|{tag}"]
        assert torch.compiler.config.cache_key_tag == "mine"  # put back
    finally:
        torch.compiler.config.cache_key_tag = ""


def test_recompile_mode_forgets_every_compiled_frame_on_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PyTorch 2.1's way, forced on any version: the mechanism is the same code
    monkeypatch.setattr(lever_guard, "guard_mode", lambda: RECOMPILE)
    monkeypatch.setattr(lever_guard, "_PROCESS", lever_guard._ProcessCaches())
    guarded = speedflags.guard_levers(attention, backend="aot_eager")
    start = graphs()
    check_flash_then_math(guarded)
    assert graphs() - start == 4  # compiled again after each of the three changes
    stats = guarded.stats  # type: ignore[attr-defined]
    assert (stats.mode, stats.states, stats.recompiles) == (RECOMPILE, 2, 3)
