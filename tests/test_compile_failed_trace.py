"""What a compiled call that fails leaves behind, and what a failure after a graph break means.

- PyTorch 2.1's dynamo enters a traced ``torch.autocast`` region for real while it traces and
  does not exit it when tracing fails: the caller's thread stays in autocast (bf16 matmuls,
  the nesting counter one up). ``@speedup(compile=...)`` and ``guard_levers`` run the compiled
  call and put it back; a bare ``torch.compile`` of the user's own cannot be helped
  (``speedflags/_compile/autocast_left.py``, ``docs/inside_compile.md``). Later PyTorch exits
  the region itself: there the checks below hold without speedflags doing anything.
- A frame dynamo resumes after a graph break, cannot compile and runs eagerly, runs on what
  the compiled part before it produced. A compiled part that computes differently from eager
  code (a branch on ``torch.compiler.is_compiling()``, as transformers' attention-mask helpers
  take) can make it raise where the step run eagerly does not. Its error is taken for the
  step's own once, and for compiling's when the next call raises it there too: the step falls
  back (``GuardedCompile._unattributed``).

Each test runs on every CI leg, the floor (PyTorch 2.1.2) included.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from conftest import last_seq, records_since

import speedflags
from speedflags import CompileFallbackWarning, fast_math, guard_levers, speedup
from speedflags._compile import autocast_left

is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", torch._dynamo.is_compiling
)
# PyTorch 2.1's dynamo leaves a traced autocast region entered when tracing fails (probed)
LEAVES_AUTOCAST = torch.__version__ < "2.2"

A, BAD = torch.ones(2, 3), torch.ones(4, 5)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # PyTorch 2.1 keys compiled code by the code object alone: each test compiles anew
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def amp_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with fast_math(amp="bf16", device="cpu"):  # traced as a torch.autocast region
        return a @ b  # BAD: a shape error dynamo's fake tensors meet while tracing


def autocast_now() -> tuple[torch.dtype, Any]:
    return (A @ A.T).dtype, autocast_left.held()


# --- item 8: autocast left entered by a trace that failed (PyTorch 2.1) -------------------


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_a_speedup_step_whose_trace_fails_inside_an_amp_block_leaves_autocast_off(
    fullgraph: bool,
) -> None:
    before = autocast_now()
    seq = last_seq()
    step = speedup(amp=False, compile={"backend": "aot_eager", "fullgraph": fullgraph})(amp_block)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        step(A, BAD)  # the step's own error (eagerly it raises too)
    assert autocast_now() == before  # was (bfloat16, nesting 1) on PyTorch 2.1.2
    put_back = [r for r in records_since(seq) if r.reason == autocast_left.REASON]
    assert len(put_back) == (1 if LEAVES_AUTOCAST else 0)
    if put_back:
        record = put_back[0]
        assert (record.lever, record.action) == ("amp", "restore")
        assert record.before == {"enabled": True, "dtype": "bfloat16"}
        assert record.after == {"enabled": False, "dtype": "bfloat16"}
    good = torch.ones(3, 5)
    assert step(A, good).dtype == torch.bfloat16 and autocast_now() == before


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_guard_levers_puts_back_the_autocast_a_failed_trace_left(fullgraph: bool) -> None:
    before = autocast_now()
    guarded = guard_levers(amp_block, backend="aot_eager", fullgraph=fullgraph)
    with pytest.raises(RuntimeError):
        guarded(A, BAD)
    assert autocast_now() == before


def test_a_bare_torch_compile_on_pytorch_2_1_leaves_autocast_entered() -> None:
    # The documented limit: speedflags runs no code around a bare compiled call, so the state
    # PyTorch 2.1's dynamo leaves entered stays (plain torch.autocast leaves it the same way).
    before = autocast_now()
    compiled = torch.compile(amp_block, backend="aot_eager")
    try:
        with pytest.raises(RuntimeError):
            compiled(A, BAD)
        left = autocast_now()
        assert (left != before) is LEAVES_AUTOCAST
        if LEAVES_AUTOCAST:
            assert left[0] == torch.bfloat16 and left[1][1] == before[1][1] + 1
    finally:
        autocast_left.put_back(before[1], "test cleanup", None)
    assert autocast_now() == before


def test_put_back_changes_nothing_when_nothing_changed() -> None:
    before = autocast_left.held()
    assert autocast_left.put_back(before, "nothing", None) is False
    assert autocast_left.held() == before
    assert not [r for r in speedflags.ledger().history if r.label == "nothing"]


# --- item 9: a frame resumed after a graph break raises where eager code does not ---------


X = torch.randn(2, 4, 8)
W = torch.randn(8, 8)


def attention_mask(q: torch.Tensor) -> torch.Tensor | None:
    # A stand-in for transformers' SDPA mask helpers: a full float mask when traced (here of
    # a dtype the query does not have), none when eager.
    if is_compiling():
        return torch.zeros(q.shape[-2], q.shape[-2], dtype=torch.float64)
    return None


def block(x: torch.Tensor) -> torch.Tensor:
    q = x @ W
    mask = attention_mask(q)  # computed by the compiled part
    torch._dynamo.graph_break()  # the rest: a frame dynamo resumes
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_resumed_frame_that_raises_on_two_calls_in_a_row_falls_back() -> None:
    expected = block(X)  # eagerly: no mask, no error
    step = speedup(amp=False, compile={"backend": "aot_eager"})(block)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # none on the first call
        with pytest.raises(RuntimeError, match="attn_mask dtype"):
            step(X)
    assert step.stats.mode == "compiled"  # taken for the step's own error, once
    with pytest.warns(CompileFallbackWarning, match="raised on two calls in a row in") as warned:
        with pytest.raises(RuntimeError, match="attn_mask dtype"):
            step(X)
    message = str(warned[0].message)
    assert "a frame dynamo resumed after a graph break and ran eagerly" in message
    assert "the call raised; it was not retried, as part of it ran compiled" in message
    assert step.stats.mode == "fallback"
    assert "RuntimeError: Expected attn_mask dtype" in (step.stats.fallback_reason or "")
    torch.testing.assert_close(step(X), expected)  # later calls run eagerly, and complete
    fallbacks = [r for r in speedflags.ledger().history if r.lever == "compile"]
    assert [(r.action, r.after) for r in fallbacks[-1:]] == [("fallback", "eager")]


def test_a_call_completing_between_two_such_errors_keeps_the_step_compiled() -> None:
    calls: list[bool] = []

    def sometimes(x: torch.Tensor, masked: bool) -> torch.Tensor:
        q = x @ W
        mask = attention_mask(q) if masked else None
        torch._dynamo.graph_break()
        calls.append(is_compiling())
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    step = speedup(amp=False, compile={"backend": "aot_eager"})(sometimes)
    for masked in (True, False, True):
        if masked:
            with pytest.raises(RuntimeError, match="attn_mask dtype"):
                step(X, masked)
        else:
            step(X, masked)
    assert step.stats.mode == "compiled" and step.stats.fallback_reason is None
