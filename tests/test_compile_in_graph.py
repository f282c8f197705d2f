"""speedflags inside torch.compile, beyond the matrix (``test_compile_matrix.py``).

The ledger's record of a block traced into a graph; the shorthands; bad arguments and
``strict=True`` met while tracing; a spec built outside the compiled function; specs with
nothing to apply; ``@speedup`` steps called from compiled code; the dynamo primitives
(``speedflags._tracing``) and what they rely on; and a frozen ``Linear`` compiled
with max-autotune inside a TF32 block, on both TF32 API families (issue 29, item 5).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import HAS_NEW_API, autocast_enabled, last_seq
from conftest import records_since as ledger_records

import speedflags
from speedflags import (
    InvalidValueError,
    LeverInGraphError,
    LeverUnavailableError,
    RankMismatchError,
    fast_math,
    speedup,
)
from speedflags import _tracing as tracing


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


X = torch.ones(2, 4)
W = torch.ones(4, 4)


# --- an amp block traced into the graph: recorded once per trace ------------------------


def test_a_traced_amp_block_is_recorded_once_per_compile_where_it_is_written() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        with fast_math(amp="bf16", device="cpu", label="traced amp"):
            return x @ W

    line = step.__code__.co_firstlineno + 1
    start = last_seq()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    assert compiled(X).dtype == torch.bfloat16
    assert compiled(X).dtype == torch.bfloat16  # the cached graph: nothing recorded
    (record,) = ledger_records(start)
    assert (record.lever, record.action, record.label) == ("amp", "traced", "traced amp")
    assert record.after == "bfloat16" and record.before is None
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in record.reason
    assert record.where == f"{__file__}:{line}"
    compiled(torch.ones(3, 4))  # another shape: a recompile, traced and recorded again
    assert [r.action for r in ledger_records(start)] == ["traced", "traced"]


def test_amp_false_in_a_graph_turns_an_outer_autocast_off() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        with speedflags.autocast(False, device="cpu"):
            return x @ W

    with fast_math(amp="bf16", device="cpu"):
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(X)
        assert autocast_enabled("cpu")
    assert got.dtype == torch.float32


# --- the shorthands ---------------------------------------------------------------------

# shorthand call -> the state a probe reads inside the block
SHORTHANDS: dict[str, Any] = {
    "tf32": (lambda: speedflags.tf32(), lambda: torch.backends.cuda.matmul.allow_tf32, True),
    "matmul_precision": (
        lambda: speedflags.matmul_precision("medium"),
        torch.get_float32_matmul_precision,
        "medium",
    ),
    "cudnn_benchmark": (
        lambda: speedflags.cudnn_benchmark(),
        lambda: torch.backends.cudnn.benchmark,
        True,
    ),
    "sdpa_backend": (
        lambda: speedflags.sdpa_backend("math"),
        torch.backends.cuda.flash_sdp_enabled,
        False,
    ),
    "deterministic": (
        lambda: speedflags.deterministic(),
        torch.are_deterministic_algorithms_enabled,
        True,
    ),
    "reduced_precision_reduction": (
        lambda: speedflags.reduced_precision_reduction(False),
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(SHORTHANDS))
@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_each_shorthand_in_compiled_code_runs_in_force_or_is_refused(
    name: str, fullgraph: bool
) -> None:
    make, read, wanted = SHORTHANDS[name]
    seen: list[Any] = []
    probe = torch.compiler.disable(lambda: seen.append(read()))

    def step(x: torch.Tensor) -> torch.Tensor:
        with make():
            probe()
            return x + 1

    before = speedflags.snapshot()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(LeverInGraphError, match=rf"^{name}\("):
            compiled(X)
        assert seen == []
    else:
        torch.testing.assert_close(compiled(X), X + 1)
        assert seen == [wanted]
    assert speedflags.snapshot() == before


def test_the_autocast_shorthand_is_traced_into_one_graph() -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(x: torch.Tensor) -> torch.Tensor:
        with speedflags.autocast("bf16", device="cpu"):
            return x @ W

    assert torch.compile(step, backend=counter, fullgraph=True)(X).dtype == torch.bfloat16
    assert counter.frame_count == 1


def test_shorthands_take_device_and_label_in_compiled_code_too() -> None:
    seen: list[bool] = []
    probe = torch.compiler.disable(lambda: seen.append(torch.backends.cudnn.benchmark))

    def eager_block(x: torch.Tensor) -> torch.Tensor:
        with speedflags.cudnn_benchmark(device="cpu", label="bench"):
            probe()
        return x + 1

    def traced_block(x: torch.Tensor) -> torch.Tensor:
        with speedflags.autocast("bf16", device="cpu", label="traced"):
            return x @ W

    start = last_seq()
    torch.compile(eager_block, backend="aot_eager")(X)
    assert torch.compile(traced_block, backend="aot_eager", fullgraph=True)(X).dtype == (
        torch.bfloat16
    )
    assert seen == [True]
    labels = {(r.lever, r.action): r.label for r in ledger_records(start)}
    assert labels[("cudnn_benchmark", "set")] == "bench"
    assert labels[("amp", "traced")] == "traced"


# --- errors met while tracing -----------------------------------------------------------


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_a_bad_argument_in_compiled_code_raises_the_usual_error(fullgraph: bool) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        with fast_math(amp="bf17"):
            return x + 1

    with pytest.raises(InvalidValueError, match=r"fast_math\(amp='bf17'\): not an autocast dtype"):
        torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(X)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_strict_in_compiled_code_refuses_as_it_does_eagerly(fullgraph: bool) -> None:
    # TF32 has no effect on a CPU: strict=True refuses it, traced or not
    def step(x: torch.Tensor) -> torch.Tensor:
        with fast_math(tf32=True, device="cpu", strict=True):
            return x + 1

    with pytest.raises(LeverUnavailableError, match="strict=True refuses"):
        step(X)
    with pytest.raises(LeverUnavailableError, match="strict=True refuses"):
        torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(X)


def test_the_fullgraph_error_names_the_levers_the_place_and_the_way_out() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        with fast_math(amp="bf16", sdpa="math", device="cpu"):
            return x + 1

    line = step.__code__.co_firstlineno + 1
    with pytest.raises(LeverInGraphError) as raised:
        torch.compile(step, backend="aot_eager", fullgraph=True)(X)
    message = str(raised.value)
    assert message.startswith(
        "fast_math(sdpa='math', amp='bf16', device='cpu') sets sdpa=['math'] inside a "
        f"function compiled with fullgraph=True ({__file__}:{line})"
    )
    assert "amp=" not in message.split(" inside ")[0].split(" sets ")[1]  # amp can be traced
    assert "Set it outside the compiled function" in message
    assert isinstance(raised.value, RuntimeError)  # and dynamo's own Unsupported
    assert isinstance(raised.value, torch._dynamo.exc.Unsupported)


# --- a spec built outside the compiled function --------------------------------------------

OUTSIDE_AMP = fast_math(amp="bf16", device="cpu")
OUTSIDE_DETERMINISTIC = fast_math(deterministic=True, device="cpu")


def test_a_spec_built_outside_runs_its_block_eagerly_with_the_levers_in_force() -> None:
    seen: list[bool] = []
    read = torch.are_deterministic_algorithms_enabled
    probe = torch.compiler.disable(lambda: seen.append(read()))

    def step(x: torch.Tensor) -> torch.Tensor:
        with OUTSIDE_AMP:
            y = x @ W
        with OUTSIDE_DETERMINISTIC:
            probe()
        return y

    start = last_seq()
    compiled = torch.compile(step, backend="aot_eager")
    assert compiled(X).dtype == torch.bfloat16
    assert seen == [True]
    actions = [(r.lever, r.action) for r in ledger_records(start)]
    assert actions == [
        ("amp", "set"),
        ("amp", "restore"),
        ("deterministic", "set"),
        ("deterministic", "restore"),
    ]


def test_a_spec_built_outside_is_refused_by_dynamo_under_fullgraph() -> None:
    # Dynamo refuses a `with` on an object it did not see built, before calling __enter__
    # (2.13: "Unsupported context manager"; 2.1: "SETUP_WITH UserDefinedObjectVariable"):
    # its error, not speedflags'. docs/inside_compile.md and docs/torch_compile.md say to build
    # it inline.
    def step(x: torch.Tensor) -> torch.Tensor:
        with OUTSIDE_AMP:
            return x @ W

    with pytest.raises(torch._dynamo.exc.Unsupported, match="FastMath"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(X)


# What dynamo does with these blocks, per PyTorch version (issue 38, item 10): measured on
# 2.1.2, 2.13 and 2.15, and said so in docs/torch_compile.md's table and docs/inside_compile.md.
ENTERS_SOURCED = torch.__version__ >= "2.15"  # dynamo calls __enter__ of an object built outside


def graph_ops() -> Any:
    """A backend that keeps, per graph it is given, the names of the calls in it."""
    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_method")])  # fmt: skip
        return gm.forward

    backend.graphs = graphs  # type: ignore[attr-defined]
    return backend


def test_the_code_before_a_process_wide_block_is_compiled_and_the_rest_runs_eagerly() -> None:
    # Not "a graph break around the block": dynamo does not resume compiling inside a `with`
    # whose enter it kept out, so the block and everything after it run eagerly (the lever in
    # force), and a block around the whole function leaves no graph at all.
    seen: list[bool] = []
    probe = torch.compiler.disable(lambda: seen.append(torch.backends.cudnn.benchmark))

    def before_block_after(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        with fast_math(cudnn_benchmark=True):
            probe()
            y = y * 2
        return torch.sin(y - 3)

    def block_first(x: torch.Tensor) -> torch.Tensor:
        with fast_math(cudnn_benchmark=True):
            y = x * 2
        return torch.sin(y)

    for step, expected in ((before_block_after, [["add"]]), (block_first, [])):
        torch._dynamo.reset()
        backend = graph_ops()
        compiled = torch.compile(step, backend=backend)
        torch.testing.assert_close(compiled(X), step(X))
        assert backend.graphs == expected, step.__name__
    assert seen == [True, True]  # the lever in force in the block, compiled as eagerly


@fast_math(cudnn_benchmark=True)
def _decorated(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_decorated_call_is_a_graph_break_with_graphs_before_and_after() -> None:
    def caller(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(_decorated(x + 1))

    backend = graph_ops()
    torch.testing.assert_close(torch.compile(caller, backend=backend)(X), caller(X))
    assert backend.graphs == [["add"], ["sin"]]
    torch._dynamo.reset()
    backend = graph_ops()
    torch.compile(_decorated, backend=backend)(X)
    assert backend.graphs == []  # compiled itself: its body eager in its frame


def test_a_spec_built_outside_per_version() -> None:
    # 2.1.2 compiles the code before the `with`; 2.13 and 2.15 run the whole function eagerly.
    # Under fullgraph=True: dynamo's own Unsupported on 2.1.2 and 2.13; 2.15 enters the spec
    # while tracing, and speedflags raises LeverInGraphError (docs/inside_compile.md).
    def step(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        with OUTSIDE_DETERMINISTIC:
            y = y * 2
        return y

    backend = graph_ops()
    torch.testing.assert_close(torch.compile(step, backend=backend)(X), step(X))
    assert backend.graphs == ([] if torch.__version__ >= "2.2" else [["add"]])
    for spec in (OUTSIDE_DETERMINISTIC, OUTSIDE_AMP):

        def inside(x: torch.Tensor, spec: Any = spec) -> torch.Tensor:
            with spec:
                return x @ W

        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported) as refused:
            torch.compile(inside, backend="aot_eager", fullgraph=True)(X)
        assert isinstance(refused.value, LeverInGraphError) is ENTERS_SOURCED
        if ENTERS_SOURCED:
            assert "spec built outside the compiled function" in str(refused.value)


def test_a_fastmath_built_directly_in_compiled_code_runs_eagerly() -> None:
    # FastMath(...) is traced as a user class (not through fast_math()): its block runs
    # eagerly. Under fullgraph=True 2.13 traces its __enter__ (LeverInGraphError: it cannot
    # be a graph), 2.1 fails earlier, inside FastMath.__init__ (dynamo's own error).
    def step(x: torch.Tensor) -> torch.Tensor:
        with speedflags.FastMath(amp="bf16", device="cpu"):
            return x @ W

    assert torch.compile(step, backend="aot_eager")(X).dtype == torch.bfloat16
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(step, backend="aot_eager", fullgraph=True)(X)


# --- nothing to apply -------------------------------------------------------------------


def test_a_spec_with_nothing_to_apply_is_a_no_op_in_the_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bare fast_math() applies nothing on a CPU without bf16 instructions. This CPU may
    # have them: the capability answer is faked (the arithmetic is not involved).
    import speedflags._hardware as hardware

    monkeypatch.setattr(
        hardware, "_host_cpu_bf16", lambda: hardware.Capability(False, "faked: no bf16")
    )
    hardware._clear_cache()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(x: torch.Tensor) -> torch.Tensor:
        with fast_math(device="cpu", label="bare"):
            return x @ W

    start = last_seq()
    try:
        got = torch.compile(step, backend=counter, fullgraph=True)(X)
    finally:
        hardware._clear_cache()
    assert got.dtype == torch.float32 and counter.frame_count == 1
    assert [(r.lever, r.action) for r in ledger_records(start)] == [("*", "skip")]


# --- decorated functions and @speedup steps ---------------------------------------------------


def test_many_decorated_functions_compiled_each_keep_a_cache_of_their_own() -> None:
    # Every decorated function shares the wrapper's code: dynamo would keep all their
    # compiled variants in one cache of 8, then run the ninth eagerly (and compile the
    # ledger's lever writes, which graphs drop). Each wrapper has a code object of its own.
    decorated = [fast_math(amp="bf16", device="cpu")(lambda x, k=k: x @ (W * k)) for k in range(10)]
    assert len({id(f.__code__) for f in decorated}) == 10
    for k, fn in enumerate(decorated):
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(X)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), X @ (W * k))


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_a_speedup_step_called_from_compiled_code_runs_eagerly_with_its_levers(
    fullgraph: bool,
) -> None:
    seen: list[bool] = []

    @speedup(deterministic=True, amp="bf16", device="cpu")
    def inner(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.are_deterministic_algorithms_enabled())
        return x @ W

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x + 1) * 2

    compiled = torch.compile(outer, backend="aot_eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(LeverInGraphError, match="deterministic=True, amp='bfloat16'"):
            compiled(X)
        assert inner.stats.calls == 0
        return
    assert compiled(X).dtype == torch.bfloat16
    assert seen == [True] and inner.stats.calls == 1


# --- the dynamo primitives ------------------------------------------------------------------


def test_at_trace_time_marks_what_assume_constant_result_marks() -> None:
    # speedflags marks its trace-time functions without importing dynamo; if
    # torch.compiler.assume_constant_result ever marks something else, this fails
    def theirs() -> int:
        return 1

    def ours() -> int:
        return 1

    torch.compiler.assume_constant_result(theirs)
    tracing.at_trace_time(ours)
    assert theirs.__dict__ == {"_dynamo_marked_constant": True}
    assert ours.__dict__ == {"_dynamo_marked_constant": True}


def test_hooked_is_true_only_where_dynamo_compiles_what_runs() -> None:
    seen: list[Any] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        try:  # a graph break in a try block: dynamo runs this frame eagerly, its hook set
            torch._dynamo.graph_break()
            seen.append(bool(tracing.hooked()))
            seen.append(torch.compiler.disable(lambda: bool(tracing.hooked()))())
        finally:
            pass
        return x + 1

    torch.compile(step, backend="eager")(X)
    assert seen == [True, False]
    assert not tracing.hooked()


def test_a_graph_error_is_the_speedflags_error_and_dynamos_unsupported() -> None:
    error = RankMismatchError("ranks differ", levers=["tf32"], differences={"a": (1, 2)})
    both = tracing.graph_error(error)
    assert isinstance(both, RankMismatchError) and isinstance(both, RuntimeError)
    assert isinstance(both, torch._dynamo.exc.Unsupported)
    assert type(both).__name__ == "RankMismatchError" and str(both) == "ranks differ"
    assert both.levers == ("tf32",) and both.differences == {"a": (1, 2)}
    assert type(tracing.graph_error(RankMismatchError("again"))) is type(both)


def test_import_speedflags_does_not_import_dynamo() -> None:
    code = "import sys, speedflags; print('torch._dynamo' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"


# --- issue 29 item 5: a frozen Linear, max-autotune, inside a TF32 block ----------------------

TF32_STARTS: dict[str, Callable[[], None]] = {
    "legacy API": lambda: None,
    # the user set the generic node through the new API (a consistent state)
    "new API": lambda: (
        setattr(torch.backends, "fp32_precision", "tf32"),
        torch.set_float32_matmul_precision("high"),
    ),
}


@pytest.mark.parametrize("start", sorted(TF32_STARTS))
def test_a_frozen_linear_compiles_with_max_autotune_inside_a_tf32_block(
    raw_tf32: None, start: str
) -> None:
    if start == "new API" and not HAS_NEW_API:
        pytest.skip(f"PyTorch {torch.__version__} has no fp32_precision API (added in 2.9)")
    import torch._inductor.config as inductor_config

    TF32_STARTS[start]()
    assert speedflags.tf32_status().consistent
    before = speedflags.snapshot()
    # inductor's freezing (weights folded in as constants), not torch.jit.freeze; caches off
    # where PyTorch can, so that the autotune paths reading TF32 state really run
    options = {"freezing": True}
    if hasattr(inductor_config, "force_disable_caches"):
        options["force_disable_caches"] = True
    model = torch.nn.Linear(16, 8).eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), inductor_config.patch(options):
        expected = model(x)
        with fast_math(tf32=True, matmul_precision="high", device="cpu"):
            compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")
            got = compiled(x)
            assert speedflags.tf32_status().consistent
    torch.testing.assert_close(got, expected)
    assert speedflags.snapshot() == before
