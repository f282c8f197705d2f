"""Threads and asyncio tasks: frames per context, process-wide levers, conflict warnings."""

from __future__ import annotations

import asyncio
import threading
import warnings
from typing import Any

import pytest
import torch
from conftest import autocast_enabled

import speedflags
from speedflags import LedgerOrderError, LeverConflictWarning, fast_math


def _conflicts(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, LeverConflictWarning)]


def _in_threads(*targets: Any) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(target: Any) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(t,), name=f"worker-{t.__name__}") for t in targets
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    return errors


# --- threads ---------------------------------------------------------------------------------


def test_a_thread_overriding_another_threads_block_is_warned_with_both_named() -> None:
    a_in, b_done = threading.Event(), threading.Event()
    where: dict[str, str] = {}

    def a() -> None:
        with fast_math(cudnn_benchmark=True, label="block A") as frame:
            where["A"] = frame.where
            a_in.set()
            b_done.wait(10)

    def b() -> None:
        a_in.wait(10)
        with fast_math(cudnn_benchmark=False, label="block B") as frame:
            where["B"] = frame.where
        b_done.set()

    base = torch.backends.cudnn.benchmark
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _in_threads(a, b)
    [message] = _conflicts(caught)
    assert "cudnn_benchmark" in message
    assert "'block A'" in message and "'block B'" in message
    assert "worker-a" in message and "worker-b" in message
    assert where["A"] in message and where["B"] in message
    assert where["A"].startswith(__file__) and where["B"].startswith(__file__)
    assert torch.backends.cudnn.benchmark is base
    assert speedflags.ledger().open_frames() == ()


def test_same_value_nesting_across_threads_does_not_warn() -> None:
    a_in, b_done = threading.Event(), threading.Event()

    def a() -> None:
        with fast_math(cudnn_benchmark=True, matmul_precision="high"):
            a_in.set()
            b_done.wait(10)

    def b() -> None:
        a_in.wait(10)
        with fast_math(cudnn_benchmark=True, matmul_precision="high"):
            pass
        b_done.set()

    before = speedflags.snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _in_threads(a, b)
    assert _conflicts(caught) == []
    assert speedflags.snapshot() == before


def test_nesting_in_one_thread_does_not_warn() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fast_math(cudnn_benchmark=True):
            with fast_math(cudnn_benchmark=False):
                pass
    assert _conflicts(caught) == []


# --- asyncio tasks ---------------------------------------------------------------------------


def test_tasks_interleaving_blocks_across_awaits_exit_in_any_order() -> None:
    before = speedflags.snapshot()
    seen: list[str] = []

    async def main() -> None:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def task_a() -> None:
            with fast_math(matmul_precision="high", label="task A"):
                a_in.set()
                await b_in.wait()
            a_out.set()  # A, entered first, exits first while B is still open

        async def task_b() -> None:
            await a_in.wait()
            with fast_math(matmul_precision="medium", label="task B"):
                b_in.set()
                await a_out.wait()
                seen.append(torch.get_float32_matmul_precision())

        await asyncio.gather(task_a(), task_b())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    assert seen == ["medium"]  # B's value holds after A exits
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()
    [message] = _conflicts(caught)
    assert "'task A'" in message and "'task B'" in message and "matmul_precision" in message


def test_async_with_interleaving_tasks() -> None:
    before = speedflags.snapshot()

    async def main() -> None:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def task_a() -> None:
            async with fast_math(matmul_precision="high", cudnn_benchmark=True, label="A"):
                a_in.set()
                await b_in.wait()
            a_out.set()

        async def task_b() -> None:
            await a_in.wait()
            async with fast_math(matmul_precision="medium", label="B"):
                b_in.set()
                await a_out.wait()
                assert torch.get_float32_matmul_precision() == "medium"
                assert torch.backends.cudnn.benchmark is False  # A's own lever went with A

        await asyncio.gather(task_a(), task_b())

    with pytest.warns(LeverConflictWarning, match="matmul_precision"):
        asyncio.run(main())
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_async_with_applies_and_restores() -> None:
    before = speedflags.snapshot()

    async def main() -> str:
        async with fast_math(cudnn_benchmark=True, amp="bf16", device="cpu") as frame:
            assert torch.backends.cudnn.benchmark is True
            assert autocast_enabled("cpu")
            await asyncio.sleep(0)
            assert torch.backends.cudnn.benchmark is True
        assert frame.closed
        return frame.where

    where = asyncio.run(main())
    assert where.startswith(__file__ + ":")
    assert speedflags.snapshot() == before


def test_a_task_created_inside_a_block_has_its_own_frames() -> None:
    # The child inherits the parent's open frames as a snapshot; the parent exiting first
    # is not an out-of-order exit in either context.
    before = speedflags.snapshot()

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def child() -> None:
            with fast_math(sdpa="math", label="child"):
                started.set()
                await release.wait()

        with fast_math(cudnn_benchmark=True, label="parent"):
            task = asyncio.create_task(child())
            await started.wait()
        assert torch.backends.cudnn.benchmark is before["cudnn_benchmark"]
        release.set()
        await task

    asyncio.run(main())
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_out_of_order_exit_within_one_task_is_still_an_error() -> None:
    outer = fast_math(cudnn_benchmark=True, label="outer")
    inner = fast_math(cudnn_benchmark=False, label="inner")
    before = speedflags.snapshot()

    async def main() -> None:
        outer.__enter__()
        await asyncio.sleep(0)
        inner.__enter__()
        with pytest.raises(LedgerOrderError, match="'outer'"):
            outer.__exit__(None, None, None)
        inner.__exit__(None, None, None)

    asyncio.run(main())
    assert speedflags.snapshot() == before


def test_conflict_warning_as_error_leaves_nothing_entered() -> None:
    before = speedflags.snapshot()

    async def main() -> None:
        a_in, b_done = asyncio.Event(), asyncio.Event()

        async def task_a() -> None:
            async with fast_math(cudnn_benchmark=True, label="A"):
                a_in.set()
                await b_done.wait()
                assert torch.backends.cudnn.benchmark is True

        async def task_b() -> None:
            await a_in.wait()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", LeverConflictWarning)
                    with pytest.raises(LeverConflictWarning):
                        with fast_math(cudnn_benchmark=False, label="B"):
                            raise AssertionError("the block must not run")
                assert torch.backends.cudnn.benchmark is True  # B entered nothing
            finally:
                b_done.set()

        await asyncio.gather(task_a(), task_b())

    asyncio.run(main())
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


def test_lever_conflict_warning_is_public() -> None:
    assert issubclass(LeverConflictWarning, speedflags.SpeedflagsWarning)
    assert LeverConflictWarning.__module__ == "speedflags"
    assert "LeverConflictWarning" in speedflags.__all__


def test_per_thread_stacks_do_not_pile_up() -> None:
    # emptied per-thread (autocast) stacks are kept for the thread's next frame; those of
    # threads gone must still be dropped, or a server starting threads would grow forever
    def one_block() -> None:
        with fast_math(amp="bf16", device="cpu"):
            pass

    for _ in range(200):
        worker = threading.Thread(target=one_block)
        worker.start()
        worker.join(30)
    assert len(speedflags.ledger().stacks.by_key) <= 80


def test_the_stacks_of_models_no_longer_under_a_lever_do_not_pile_up() -> None:
    # Failed before: each model has a domain of its own, and their emptied stacks were kept
    # for ever (a process making models, a test suite or a tuning loop, grew without bound)
    for _ in range(200):
        net = torch.nn.Linear(2, 2)
        with fast_math(model=net, param_dtype="bf16"):
            net(torch.ones(1, 2))
    assert len(speedflags.ledger().stacks.by_key) <= 80


def test_each_frame_records_its_threads_name_at_entry_and_a_renamed_thread_its_new_one() -> None:
    spec = fast_math(cudnn_benchmark=True, label="named")
    names: list[str] = []

    def work() -> None:
        for name in ("first", "second"):
            threading.current_thread().name = name  # the ledger knows the thread by now
            with spec as frame:
                names.append(frame.thread)

    assert _in_threads(work) == []
    with spec as frame:
        names.append(frame.thread)
    assert names == ["first", "second", threading.current_thread().name]
    records = [r for r in speedflags.ledger().history if r.label == "named"][-6:]
    assert [r.thread for r in records] == ["first"] * 2 + ["second"] * 2 + [names[2]] * 2
