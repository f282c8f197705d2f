"""Levers and torch.compile (issue 29): an amp block inside a compiled step, against
``torch.autocast`` inside it; the per-call cost of guarding the levers dynamo does not guard;
the compiles a lever change causes.

- ``compile-amp-block``: one small MLP train step (forward and loss compiled, backward
  after), with bf16 autocast written four ways inside the compiled function, plus fp32,
  ``torch.autocast`` around the compiled call and ``@speedup(amp="bf16", compile=...)``
  (the levers outside the compiled call). The goal:
  a speedflags block within 5% of ``torch.autocast``. Each variant's first call (the
  compile) records the output's dtype, whether it matches ``torch.autocast``'s, and the
  warnings it raised (``extra_info``): a block that does not become an autocast region
  runs in float32 and says so there. A variant this PyTorch cannot compile at all is
  skipped, with dynamo's error as the reason.
- ``compile-guard-overhead``: a step that does almost nothing, compiled (backend
  ``"eager"``) plainly, through ``speedflags.guard_levers``, and through ``@speedup``: what
  reading the unguarded levers (and picking the artefact) adds per call; and
  ``lever_state()`` alone.
- ``compile-lever-switch``: an attention step called under ``sdpa="flash"`` and
  ``sdpa="math"`` in turn; ``extra_info`` holds the graphs compiled and whether the math
  calls ran the flash kernel (plain ``torch.compile`` does: it never recompiles).

Backends: ``aot_eager`` always; ``inductor`` too when timing (not with
``--benchmark-disable``, where the compiles would dominate CI's run).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import speedflags
from speedflags._compile.lever_state import lever_state

BATCH, WIDTH, HIDDEN = 64, 256, 1024
BACKENDS = ("aot_eager", "inductor")

# bf16 autocast written inside the compiled function, four ways
AMP_BLOCKS: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "torch.autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "fast_math-block": lambda: speedflags.fast_math(amp="bf16", device="cpu"),
    "autocast-shorthand": lambda: speedflags.autocast("bf16", device="cpu"),
}


# inside the compiled function: the blocks, a @fast_math function it calls; outside it: plain
# torch.autocast and @speedup's levers (for comparison)
AMP_VARIANTS = ["fp32", *AMP_BLOCKS, "fast_math-decorated", "torch.autocast-outside"]
AMP_VARIANTS += ["speedup-outside"]


def _backends(config: pytest.Config) -> list[str]:
    return ["aot_eager"] if config.getoption("benchmark_disable") else list(BACKENDS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", _backends(metafunc.config))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH)
    )


def _amp_step(variant: str, model: torch.nn.Module, backend: str) -> Callable[..., Any]:
    """The forward and loss of one train step, compiled; returns (loss, output dtype)."""
    if variant == "speedup-outside":

        @speedflags.speedup(amp="bf16", device="cpu", compile={"backend": backend})
        def outside(x: torch.Tensor) -> Any:
            y = model(x)
            return y.float().pow(2).mean(), y.dtype

        return outside
    if variant == "torch.autocast-outside":
        inner = _amp_step("fp32", model, backend)

        def around(x: torch.Tensor) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return inner(x)

        return around
    if variant == "fast_math-decorated":

        @speedflags.fast_math(amp="bf16", device="cpu")
        def forward(x: torch.Tensor) -> torch.Tensor:
            return model(x)  # type: ignore[no-any-return]

        def decorated(x: torch.Tensor) -> Any:
            y = forward(x)
            return y.float().pow(2).mean(), y.dtype

        return torch.compile(decorated, backend=backend)  # type: ignore[no-any-return]
    block = AMP_BLOCKS.get(variant)

    def step(x: torch.Tensor) -> Any:
        if block is None:  # fp32
            y = model(x)
        else:
            with block():
                y = model(x)
        return y.float().pow(2).mean(), y.dtype

    return torch.compile(step, backend=backend)  # type: ignore[no-any-return]


def _train(step: Callable[..., Any], model: torch.nn.Module, x: torch.Tensor) -> Any:
    loss, dtype = step(x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return dtype


@pytest.mark.benchmark(group="compile-amp-block")
@pytest.mark.parametrize("variant", AMP_VARIANTS)
def test_amp_block_in_compiled_step(benchmark: Any, backend: str, variant: str) -> None:
    torch._dynamo.reset()
    model = _model()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    step = _amp_step(variant, model, backend)
    before = speedflags.snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dtype = _train(step, model, x)  # compiles, outside the timing
        except Exception as exc:  # a PyTorch whose dynamo cannot trace the block at all
            first = (str(exc).strip().splitlines() or [""])[0]
            pytest.skip(f"{variant} does not compile here: {type(exc).__name__}: {first}")
    want = torch.float32 if variant == "fp32" else torch.bfloat16
    info = benchmark.extra_info
    info["config"] = f"{variant} ({backend})"
    info["baseline"] = variant == "torch.autocast"
    info["dtype"] = str(dtype).replace("torch.", "")
    info["matches_torch_autocast"] = dtype == want
    info["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the first call said is recorded above
        benchmark.pedantic(_train, args=(step, model, x), rounds=30, warmup_rounds=3)
    assert speedflags.snapshot() == before


# --- what guarding costs per call -------------------------------------------------------------


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x + 1


GUARD_VARIANTS: dict[str, Callable[[], Callable[..., Any]]] = {
    "torch.compile": lambda: torch.compile(_tiny, backend="eager"),
    "guard_levers": lambda: speedflags.guard_levers(_tiny, backend="eager"),
    "speedup-compile": lambda: speedflags.speedup(amp=False, compile={"backend": "eager"})(_tiny),
}


def _calls(fn: Callable[..., Any], x: torch.Tensor, calls: int) -> None:
    for _ in range(calls):
        fn(x)


@pytest.mark.benchmark(group="compile-guard-overhead")
@pytest.mark.parametrize("variant", [*GUARD_VARIANTS, "lever_state"])
def test_guard_overhead(benchmark: Any, variant: str) -> None:
    torch._dynamo.reset()
    calls = 200
    x = torch.ones(4)
    if variant == "lever_state":
        fn: Callable[..., Any] = lambda _: lever_state()  # noqa: E731
    else:
        fn = GUARD_VARIANTS[variant]()
        fn(x)  # compiles, outside the timing
    benchmark.extra_info["baseline"] = variant == "torch.compile"
    benchmark.extra_info["calls_per_round"] = calls
    benchmark.pedantic(_calls, args=(fn, x, calls), rounds=100, warmup_rounds=10)


# --- what a lever change costs -----------------------------------------------------------------

FLASH = (
    "aten::_scaled_dot_product_flash_attention_for_cpu"
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    else "aten::_scaled_dot_product_flash_attention"
)


def _attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q) * 2


SWITCH_VARIANTS: dict[str, Callable[[str], Callable[..., Any]]] = {
    "torch.compile": lambda backend: torch.compile(_attention, backend=backend),
    "guard_levers": lambda backend: speedflags.guard_levers(_attention, backend=backend),
    "speedup-compile": lambda backend: speedflags.speedup(amp=False, compile={"backend": backend})(
        _attention
    ),
}


def _switch(fn: Callable[..., Any], q: torch.Tensor, switches: int) -> list[bool]:
    """Call under flash and math in turn; per math call, whether the flash kernel ran."""
    flash_under_math = []
    for i in range(switches):
        state = "flash" if i % 2 == 0 else "math"
        with speedflags.sdpa_backend(state):
            if state == "flash":
                fn(q)
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn(q)
            flash_under_math.append(any(e.name == FLASH for e in prof.events()))
    return flash_under_math


@pytest.mark.benchmark(group="compile-lever-switch")
@pytest.mark.parametrize("variant", list(SWITCH_VARIANTS))
def test_lever_switch_compiles(benchmark: Any, backend: str, variant: str) -> None:
    torch._dynamo.reset()
    q = torch.randn(1, 1, 8, 8)  # one head: PyTorch 2.1's inductor fails on more (its bug)
    fn = SWITCH_VARIANTS[variant](backend)
    start = int(counters["stats"]["unique_graphs"])
    wrong = _switch(fn, q, switches=6)
    info = benchmark.extra_info
    info["config"] = f"{variant} ({backend})"
    info["baseline"] = variant == "torch.compile"
    info["graphs_compiled_in_6_calls"] = int(counters["stats"]["unique_graphs"]) - start
    info["flash_kernel_under_math"] = any(wrong)
    stats = getattr(fn, "stats", None)
    guard = getattr(stats, "lever_guard", stats)  # @speedup's stats hold it; guard_levers' are it
    if guard is not None:
        info["lever_guard"] = guard.to_dict()
    assert any(wrong) == (variant == "torch.compile")  # PyTorch's gap, and it closed
    benchmark.pedantic(_switch, args=(fn, q, 2), rounds=10, warmup_rounds=1)
