"""@fast_math on functions, methods, recursion, generators, coroutines and async generators."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

import speedflags
from speedflags import InvalidTypeError, fast_math


def benchmark_on() -> bool:
    return bool(torch.backends.cudnn.benchmark)


def test_decorated_function_runs_with_the_levers_and_restores() -> None:
    @fast_math(cudnn_benchmark=True, amp="bf16", device="cpu")
    def step(x: torch.Tensor) -> tuple[bool, torch.dtype]:
        """Doc of step."""
        return benchmark_on(), (x @ x).dtype

    before = speedflags.snapshot()
    assert step(torch.ones(2, 2)) == (True, torch.bfloat16)
    assert speedflags.snapshot() == before
    assert step.__name__ == "step" and step.__doc__ == "Doc of step."
    assert step.__wrapped__(torch.ones(2, 2)) == (False, torch.float32)


def test_exception_in_decorated_function_propagates_and_restores() -> None:
    @fast_math(cudnn_benchmark=True)
    def fails() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert not benchmark_on()


def _cpu_autocast() -> tuple[bool, torch.dtype]:
    # torch's own getters, not speedflags' snapshot: the check must not read through the code
    # under test. The device-generic getters came in 2.4; 2.1 has only the per-device ones.
    if hasattr(torch, "get_autocast_dtype"):
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def test_bare_decorator_applies_the_recommended_levers() -> None:
    # The expectation comes from the CPU's capability answer, not from recommended() (which
    # the bare decorator reads): a CPU that runs bf16 natively gets bf16 autocast and
    # nothing else; one that does not gets no lever. Either branch runs on the machine at hand.
    if torch.cuda.is_available():  # the bare decorator targets CUDA there
        pytest.skip("a CUDA machine: the bare decorator's device is the GPU")
    native_bf16 = bool(speedflags.capabilities("cpu").bf16)
    others_before = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())

    @fast_math
    def step() -> tuple[tuple[bool, torch.dtype], tuple[bool, str]]:
        others = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision())
        return _cpu_autocast(), others

    autocast_inside, others_inside = step()
    if native_bf16:
        assert autocast_inside == (True, torch.bfloat16)
    else:
        assert autocast_inside == (False, _cpu_autocast()[1])
    assert others_inside == others_before  # no other lever on a CPU
    assert _cpu_autocast()[0] is False  # restored after
    record_labels = {r.label for r in speedflags.ledger().history[-4:]}
    assert any(label.endswith("step: fast_math()") for label in record_labels)


def test_recursion_gives_each_call_its_own_frame() -> None:
    depths: list[int] = []

    @fast_math(cudnn_benchmark=True)
    def recurse(n: int) -> int:
        depths.append(len(speedflags.ledger().open_frames()))
        assert benchmark_on()
        return 0 if n == 0 else 1 + recurse(n - 1)

    assert recurse(4) == 4
    assert depths == [1, 2, 3, 4, 5]
    assert not benchmark_on()


class Model:
    def __init__(self) -> None:
        self.calls = 0

    @fast_math(cudnn_benchmark=True)
    def method(self, x: int) -> tuple[int, bool]:
        self.calls += 1
        return x + 1, benchmark_on()

    @staticmethod
    @fast_math(cudnn_benchmark=True)
    def static(x: int) -> bool:
        return benchmark_on()

    @fast_math(cudnn_benchmark=True)
    @classmethod
    def klass(cls, x: int) -> tuple[type, bool]:
        return cls, benchmark_on()


def test_methods_bind_self_and_cls() -> None:
    model = Model()
    assert model.method(1) == (2, True)
    assert model.calls == 1
    assert Model.static(1) is True
    assert Model.klass(1) == (Model, True)
    assert not benchmark_on()


def test_decorating_a_class_is_refused() -> None:
    with pytest.raises(InvalidTypeError, match="cannot decorate the class 'Model'"):
        fast_math(tf32=True)(Model)


# --- generators: levers while the body runs, not while suspended -------------------------


def test_generator_gets_the_levers_per_step() -> None:
    cleanup: list[bool] = []

    @fast_math(cudnn_benchmark=True)
    def gen() -> Iterator[bool]:
        try:
            received = yield benchmark_on()
            assert received == "hello"
            yield benchmark_on()
            yield benchmark_on()
        finally:
            cleanup.append(benchmark_on())

    g = gen()
    assert inspect.isgenerator(g)
    assert next(g) is True
    assert not benchmark_on()  # suspended: the consumer sees the flags as they were
    assert g.send("hello") is True
    assert not benchmark_on()
    g.close()  # cleanup runs with the levers, and they are restored after
    assert cleanup == [True]
    assert not benchmark_on()


def test_generator_return_value_and_throw() -> None:
    @fast_math(cudnn_benchmark=True)
    def gen() -> Iterator[int]:
        try:
            yield 1
        except KeyError:
            yield 2
        return 42

    g = gen()
    assert next(g) == 1
    assert g.throw(KeyError("x")) == 2
    with pytest.raises(StopIteration) as stop:
        next(g)
    assert stop.value.value == 42
    assert not benchmark_on()


# --- coroutines ----------------------------------------------------------------------------


def test_coroutine_gets_the_levers_per_step_and_other_tasks_do_not() -> None:
    seen: list[tuple[str, bool]] = []

    @fast_math(cudnn_benchmark=True)
    async def fast_task() -> str:
        for _ in range(3):
            seen.append(("fast", benchmark_on()))
            await asyncio.sleep(0)
        return "done"

    async def plain_task() -> None:
        for _ in range(3):
            seen.append(("plain", benchmark_on()))
            await asyncio.sleep(0)

    async def main() -> str:
        result, _ = await asyncio.gather(fast_task(), plain_task())
        return result

    assert asyncio.run(main()) == "done"
    assert ("fast", True) in seen and ("plain", True) not in seen
    assert all(flag for who, flag in seen if who == "fast")
    assert not benchmark_on()


def test_coroutine_exception_propagates_and_restores() -> None:
    @fast_math(tf32=True)
    async def fails() -> None:
        await asyncio.sleep(0)
        raise LookupError("async")

    before = speedflags.snapshot()
    with pytest.raises(LookupError, match="async"):
        asyncio.run(fails())
    assert speedflags.snapshot() == before


def test_concurrent_tasks_with_different_settings_see_their_own() -> None:
    seen: list[tuple[str, bool]] = []

    @fast_math(cudnn_benchmark=True)
    async def on() -> None:
        for _ in range(4):
            seen.append(("on", benchmark_on()))
            await asyncio.sleep(0)

    @fast_math(cudnn_benchmark=False)
    async def off() -> None:
        for _ in range(4):
            seen.append(("off", benchmark_on()))
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(on(), off(), on())

    asyncio.run(main())
    assert all(flag is (who == "on") for who, flag in seen)
    assert speedflags.ledger().open_frames() == ()


def test_async_generator_gets_the_levers_per_step() -> None:
    cleanup: list[bool] = []

    @fast_math(cudnn_benchmark=True)
    async def agen() -> AsyncIterator[bool]:
        try:
            for _ in range(3):
                await asyncio.sleep(0)
                yield benchmark_on()
        finally:
            cleanup.append(benchmark_on())

    async def main() -> list[Any]:
        got = []
        gen = agen()
        async for flag in gen:
            got.append((flag, benchmark_on()))
            if len(got) == 2:
                break
        await gen.aclose()
        return got

    assert asyncio.run(main()) == [(True, False), (True, False)]
    assert cleanup == [True]
    assert not benchmark_on()


def test_async_generator_athrow_and_exhaustion() -> None:
    @fast_math(cudnn_benchmark=True)
    async def agen() -> AsyncIterator[int]:
        try:
            yield 1
        except KeyError:
            yield 2

    async def main() -> list[int]:
        gen = agen()
        out = [await gen.__anext__(), await gen.athrow(KeyError("k"))]
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        return out

    assert asyncio.run(main()) == [1, 2]
    assert not benchmark_on()
