"""Every lever, in every place it may be set, under torch.compile: eager's numbers, or an error.

The matrix of issue 29: place x lever x {default, fullgraph=True} x {aot_eager, inductor}.

Places (where the ``fast_math`` levers are given):

- ``with_block``: ``with fast_math(...):`` written inside the compiled function;
- ``module_forward``: the same block in the ``forward`` of a compiled ``nn.Module``;
- ``compiled_decorated``: ``torch.compile`` of a ``@fast_math(...)`` function;
- ``decorated_called``: a ``@fast_math(...)`` function called by a compiled function;
- ``speedup``: ``@speedup(compile=..., **levers)`` (the levers set around the compiled call).

What each cell must give, on PyTorch 2.1 and the newest alike (``docs/inside_compile.md``):

- ``amp`` in the first four places is traced into the graph as ``torch.autocast``: one
  graph, ``fullgraph=True`` works, eager's dtype and values, gradients too; the ledger
  records the block as ``traced`` (never a restore without a set).
- a process-wide lever in the first four places runs eagerly, a graph break around it, with
  the lever in force (read inside the block by a probe dynamo does not trace) and restored
  after; with ``fullgraph=True`` it raises :class:`~speedflags.LeverInGraphError` naming
  the lever, at compile time, before anything runs.
- ``speedup`` sets every lever outside the graph: eager's numbers, also with
  ``fullgraph=True``, and the step stays compiled.

And in every cell: no ``DriftWarning``, ``StateMismatchError`` or other speedflags warning, no
dynamo warning or log line naming speedflags' code, and ``speedflags.snapshot()`` after the
cell equals the one before.

Both backends run the whole matrix: 100 cells, 40-70 s on two cores with an empty inductor
cache (measured on PyTorch 2.13 and 2.1.2). The inputs are tiny, the ``fullgraph=True``
refusals are raised while tracing (before a backend runs), and dynamo is reset before every
cell. The SDPA inputs have a batch of two: PyTorch 2.1's inductor fails a stride assertion on
its own flash-attention output for a batch of one with two heads.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import last_seq, records_since

import speedflags
from speedflags import LeverInGraphError, SpeedflagsWarning, fast_math, speedup

PACKAGE = os.path.dirname(os.path.abspath(speedflags.__file__))

LEVERS: dict[str, dict[str, Any]] = {
    "amp": {"amp": "bf16"},
    "sdpa": {"sdpa": "math"},
    "deterministic": {"deterministic": True},
    "tf32_precision": {"tf32": True, "matmul_precision": "high"},
    "cudnn_benchmark": {"cudnn_benchmark": True},
}

# What the probe reads inside the block, and what it must read there (the lever in force).
IN_FORCE: dict[str, tuple[Callable[[], Any], Any]] = {
    "sdpa": (
        lambda: (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()),
        (False, True),
    ),
    "deterministic": (torch.are_deterministic_algorithms_enabled, True),
    "tf32_precision": (
        lambda: (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32),
        ("high", True),
    ),
    "cudnn_benchmark": (lambda: torch.backends.cudnn.benchmark, True),
}

PLACES = ("with_block", "module_forward", "compiled_decorated", "decorated_called", "speedup")
BACKENDS = ("aot_eager", "inductor")


CELLS = [
    pytest.param(place, lever, fullgraph, backend, id=f"{place}-{lever}-{mode}-{backend}")
    for backend in BACKENDS
    for place in PLACES
    for lever in LEVERS
    for fullgraph, mode in ((False, "default"), (True, "fullgraph"))
]


class Probe:
    """Reads a lever's state where it runs, kept out of dynamo's graphs (a graph break)."""

    def __init__(self, lever: str) -> None:
        self.read = IN_FORCE[lever][0] if lever in IN_FORCE else None
        self.seen: list[Any] = []
        self.call = torch.compiler.disable(self._record)

    def _record(self) -> None:
        if self.read is not None:
            self.seen.append(self.read())


def attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The block's body: a matmul (autocast, TF32, matmul precision) and SDPA."""
    q = x @ w
    return F.scaled_dot_product_attention(q, q, q)


def build(
    place: str,
    levers: dict[str, Any],
    probe: Probe,
    compile_options: dict[str, Any],
    device: str = "cpu",
):
    """(the function to compile, or the compiled @speedup step; the same run eagerly)."""
    levers = {**levers, "device": device}
    use_probe = probe.read is not None

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if use_probe:
            probe.call()
        return attention(x, w)

    if place == "with_block":

        def with_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = x * 2
            with fast_math(**levers):
                y = body(y, w)
            return y + 1

        return with_block, with_block
    if place == "module_forward":

        class Attention(torch.nn.Module):
            def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                with fast_math(**levers):
                    return body(x, w)

        module = Attention()
        return module, module
    if place in ("compiled_decorated", "decorated_called"):
        decorated = fast_math(**levers)(body)
        if place == "compiled_decorated":
            return decorated, decorated

        def caller(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return decorated(x * 2, w) + 1

        return caller, caller
    step = speedup(compile=compile_options, **levers)(attention)
    return step, fast_math(**levers)(attention)


def run(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor):
    """Two calls (the second from the compiled cache): the output and the gradient of ``w``."""
    fn(x, w.detach().clone().requires_grad_())
    w = w.detach().clone().requires_grad_()
    out = fn(x, w)
    out.float().sum().backward()
    return out, w.grad


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("place", "lever", "fullgraph", "backend"), CELLS)
def test_cell(
    place: str, lever: str, fullgraph: bool, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    check_cell(place, lever, fullgraph, backend, caplog, "cpu")


def check_cell(
    place: str,
    lever: str,
    fullgraph: bool,
    backend: str,
    caplog: pytest.LogCaptureFixture,
    device: str,
) -> None:
    """One cell of the matrix on ``device`` (tests/test_gpu_compile.py runs it on CUDA)."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 16, 8).to(device)
    w = torch.randn(8, 8).to(device) / 8  # logits of order one: a softmax rounding won't tip
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    probe = Probe(lever)
    options = {"backend": counter, "fullgraph": fullgraph}
    fn, eager_fn = build(place, LEVERS[lever], probe, options, device)
    before = speedflags.snapshot()
    expected, expected_grad = run(eager_fn, x, w)
    probe.seen.clear()
    start = last_seq()
    refused = lever != "amp" and place != "speedup" and fullgraph

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        if place == "speedup":
            compiled = fn
        else:
            compiled = torch.compile(fn, backend=counter, fullgraph=fullgraph)
        if refused:
            with pytest.raises(LeverInGraphError) as raised:
                compiled(x, w)
        else:
            got, got_grad = run(compiled, x, w)

    assert speedflags.snapshot() == before
    ours = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, SpeedflagsWarning)
        or PACKAGE in str(w.message)
        or w.filename.startswith(PACKAGE)
    ]
    assert ours == []
    assert [r.getMessage() for r in caplog.records if PACKAGE in r.getMessage()] == []
    records = records_since(start)

    if refused:
        message = str(raised.value)
        for name in LEVERS[lever]:
            assert f"{name}=" in message
        assert "fullgraph=True" in message and "outside the compiled function" in message
        assert "@speedup(compile=" in message
        assert records == [] and probe.seen == [] and counter.frame_count == 0
        return

    assert got.dtype == expected.dtype
    assert got_grad is not None and expected_grad is not None
    if backend == "aot_eager":  # the same kernels as eager: the same bits
        assert torch.equal(got, expected)
        assert torch.equal(got_grad, expected_grad)
    elif device == "cuda" and lever == "tf32_precision":
        # eager and inductor both multiply in TF32 (10-bit mantissa), through different
        # cuBLAS calls: TF32's rounding apart, not fp32's
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(got_grad, expected_grad, rtol=2e-3, atol=2e-3)
    else:  # inductor fuses and decomposes: eager's values within the dtype's rounding
        torch.testing.assert_close(got, expected)
        if lever == "amp":
            # the gradient of a float32 weight summed from bf16 products: inductor rounds at
            # other points than eager, so one bf16 rounding of the largest entry apart
            scale = float(expected_grad.abs().max())
            torch.testing.assert_close(got_grad, expected_grad, rtol=2**-7, atol=2**-8 * scale)
        else:
            torch.testing.assert_close(got_grad, expected_grad)

    if place == "speedup":
        assert fn.stats.mode == "compiled" and counter.frame_count == 1
        assert [(r.lever, r.action) for r in records if r.lever != "compile"] == [
            (r.lever, r.action) for r in records if r.action in ("set", "restore")
        ]
        return
    if lever == "amp":
        assert expected.dtype == torch.bfloat16
        assert counter.frame_count == 1  # one graph
        assert {(r.lever, r.action) for r in records} == {("amp", "traced")}
        assert all(r.where.startswith(__file__) for r in records)
        return
    # a process-wide lever: in force where the block ran, and restored after
    value = IN_FORCE[lever][1]
    assert probe.seen == [value, value]
    actions = [r.action for r in records]
    assert actions and actions.count("set") == actions.count("restore")
    assert "traced" not in actions
    assert all(r.where.startswith(__file__) for r in records)
