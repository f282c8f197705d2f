"""What the body of a decorated generator or coroutine holds across ``yield`` and ``await``.

A block held across a suspension (``async with fast_math(...)``, a ``with`` around a
``yield``) inside a ``@fast_math``/``@speedup`` coroutine or generator, and the body's own
``torch.autocast`` region around an ``await``, are the body's: set aside while it is
suspended, put back when it resumes, never overridden by the step's levers
(``speedflags/_ledger/suspend.py``).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from conftest import last_seq, records_since

import speedflags
from speedflags import DriftWarning, fast_math, speedup
from speedflags.levers import PROCESS_LEVERS

X = torch.randn(4, 4)


def benchmark_on() -> bool:
    return bool(torch.backends.cudnn.benchmark)


def dtype() -> torch.dtype:
    return (X @ X).dtype


@pytest.fixture(autouse=True)
def _warnings_are_errors() -> Iterator[None]:
    # a DriftWarning or LeverConflictWarning would fail the test
    with warnings.catch_warnings():
        warnings.simplefilter("error", speedflags.SpeedflagsWarning)
        # bf16 emulated on this CPU (an AVX2 EPYC) is said once per process, not a finding here
        warnings.simplefilter("ignore", speedflags.SlowPathWarning)
        yield


# --- item 1: a block held across await / yield -------------------------------------------


@pytest.mark.parametrize("form", ["async with", "with"])
def test_a_block_held_across_await_in_a_decorated_coroutine(form: str) -> None:
    @fast_math(amp="bf16", device="cpu")
    async def step() -> list[Any]:
        seen = [(benchmark_on(), dtype())]
        if form == "async with":
            async with fast_math(cudnn_benchmark=True):
                await asyncio.sleep(0)
                seen.append((benchmark_on(), dtype()))
        else:
            with fast_math(cudnn_benchmark=True):
                await asyncio.sleep(0)
                seen.append((benchmark_on(), dtype()))
        await asyncio.sleep(0)
        seen.append((benchmark_on(), dtype()))
        return seen

    before = speedflags.snapshot()
    assert asyncio.run(step()) == [
        (False, torch.bfloat16),
        (True, torch.bfloat16),
        (False, torch.bfloat16),
    ]
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_a_block_held_across_await_in_a_speedup_step() -> None:
    @speedup(amp="bf16", device="cpu")
    async def step() -> tuple[bool, torch.dtype]:
        async with fast_math(cudnn_benchmark=True):
            await asyncio.sleep(0)
            return benchmark_on(), dtype()

    assert asyncio.run(step()) == (True, torch.bfloat16)
    assert not benchmark_on()
    assert speedflags.ledger().open_frames() == ()


def test_other_tasks_never_see_what_a_decorated_coroutine_holds() -> None:
    seen: list[tuple[str, bool, torch.dtype]] = []

    @fast_math(amp="bf16", device="cpu")
    async def fast() -> None:
        async with fast_math(cudnn_benchmark=True):
            for _ in range(3):
                seen.append(("fast", benchmark_on(), dtype()))
                await asyncio.sleep(0)

    async def plain() -> None:
        for _ in range(4):
            seen.append(("plain", benchmark_on(), dtype()))
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(fast(), plain())

    asyncio.run(main())
    assert [s for s in seen if s[0] == "fast"] == [("fast", True, torch.bfloat16)] * 3
    assert [s for s in seen if s[0] == "plain"] == [("plain", False, torch.float32)] * 4


def test_a_block_held_across_yield_in_a_decorated_generator() -> None:
    @fast_math(amp="bf16", device="cpu")
    def gen() -> Iterator[tuple[bool, torch.dtype]]:
        with fast_math(cudnn_benchmark=True):
            yield benchmark_on(), dtype()
            yield benchmark_on(), dtype()
        yield benchmark_on(), dtype()

    it = gen()
    assert next(it) == (True, torch.bfloat16)
    assert (benchmark_on(), dtype()) == (False, torch.float32)  # the consumer: nothing held
    # the consumer's own block, entered and exited between two steps: no order error
    with fast_math(cudnn_benchmark=False, label="consumer"):
        assert next(it) == (True, torch.bfloat16)
        assert not benchmark_on()
    assert next(it) == (False, torch.bfloat16)
    assert list(it) == []
    assert speedflags.ledger().open_frames() == ()


def test_a_generator_closed_while_it_holds_a_block_restores_everything() -> None:
    cleanup: list[bool] = []

    @fast_math(amp="bf16", device="cpu")
    def gen() -> Iterator[int]:
        with fast_math(cudnn_benchmark=True):
            try:
                yield 1
                yield 2
            finally:
                cleanup.append(benchmark_on())

    before = speedflags.snapshot()
    it = gen()
    next(it)
    it.close()
    assert cleanup == [True]  # the cleanup ran inside the block, put back
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_an_exception_inside_a_held_block_after_await_restores_everything() -> None:
    @fast_math(amp="bf16", device="cpu")
    async def fails() -> None:
        async with fast_math(cudnn_benchmark=True):
            await asyncio.sleep(0)
            raise LookupError("after await")

    before = speedflags.snapshot()
    with pytest.raises(LookupError, match="after await"):
        asyncio.run(fails())
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_an_async_generator_holds_a_block_across_yield_and_await() -> None:
    @fast_math(amp="bf16", device="cpu")
    async def agen() -> AsyncIterator[tuple[bool, torch.dtype]]:
        async with fast_math(cudnn_benchmark=True):
            await asyncio.sleep(0)
            yield benchmark_on(), dtype()
            await asyncio.sleep(0)
            yield benchmark_on(), dtype()

    async def main() -> list[Any]:
        return [(item, benchmark_on(), dtype()) async for item in agen()]

    inside = (True, torch.bfloat16)
    assert asyncio.run(main()) == [(inside, False, torch.float32)] * 2
    assert speedflags.ledger().open_frames() == ()


def test_a_frame_the_body_holds_is_the_same_object_after_resuming() -> None:
    lever = PROCESS_LEVERS["cudnn_benchmark"]

    @fast_math(amp="bf16", device="cpu")
    def gen() -> Iterator[Any]:
        frame = speedflags.ledger().open([(lever, True)], label="held by hand")
        yield frame.closed, benchmark_on()
        yield frame.closed, benchmark_on()
        frame.close()  # the Frame the body kept: open again, and closed once
        yield frame.closed, benchmark_on()

    assert list(gen()) == [(False, True), (False, True), (True, False)]
    assert not benchmark_on()
    records = [r for r in speedflags.ledger().history if r.label == "held by hand"]
    assert [r.action for r in records] == ["set", "restore", "set", "restore", "set", "restore"]


# --- item 2: the body's own state is not overridden on resume ----------------------------


def test_the_body_autocast_region_stays_float32_after_await() -> None:
    @fast_math(amp="bf16", device="cpu")
    async def step() -> list[torch.dtype]:
        out = [dtype()]
        with torch.autocast("cpu", enabled=False):
            out.append(dtype())
            await asyncio.sleep(0)
            out.append(dtype())  # was bfloat16: the step's levers put back over the region
        out.append(dtype())
        await asyncio.sleep(0)
        out.append(dtype())
        return out

    before = speedflags.snapshot()
    bf16, fp32 = torch.bfloat16, torch.float32
    assert asyncio.run(step()) == [bf16, fp32, fp32, bf16, bf16]  # no DriftWarning either
    assert speedflags.snapshot() == before


def test_the_body_autocast_region_stays_float32_after_yield() -> None:
    @fast_math(amp="bf16", device="cpu")
    def gen() -> Iterator[torch.dtype]:
        with torch.autocast("cpu", enabled=False):
            yield dtype()
            yield dtype()  # was a DriftWarning, then bfloat16
        yield dtype()

    seq = last_seq()
    it = gen()
    assert next(it) == torch.float32
    assert dtype() == torch.float32  # the consumer: not in the step's autocast
    assert list(it) == [torch.float32, torch.bfloat16]
    records = [(r.action, r.reason.split(":")[0]) for r in records_since(seq)]
    held, put_back = ("restore", "held by the body across a yield or await"), ("set", "put back")
    assert records.count(held) == 2 and records.count(put_back) == 2


def test_a_shared_lever_block_inside_keeps_its_value_after_await() -> None:
    @fast_math(amp="bf16", device="cpu")
    async def step() -> list[torch.dtype]:
        out = []
        async with fast_math(amp=False, device="cpu"):  # the same lever, off, inside
            out.append(dtype())
            await asyncio.sleep(0)
            out.append(dtype())
        out.append(dtype())  # back to the decorator's
        await asyncio.sleep(0)
        out.append(dtype())
        return out

    assert asyncio.run(step()) == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    assert dtype() == torch.float32


def test_a_change_the_body_leaves_at_its_end_is_still_drift() -> None:
    @fast_math(cudnn_benchmark=True)
    async def step() -> None:
        await asyncio.sleep(0)
        torch.backends.cudnn.benchmark = False  # left so: drift, warned and restored
        await asyncio.sleep(0)

    with pytest.warns(DriftWarning, match="cudnn_benchmark was changed inside"):
        with warnings.catch_warnings():
            warnings.simplefilter("always", DriftWarning)
            asyncio.run(step())
    assert not benchmark_on()
