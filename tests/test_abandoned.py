"""Blocks no thread can exit any more: left open by a thread that ended, entered in one
thread and exited in another, or belonging to another thread at a fork. And the messages of
a block exited twice."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import pytest
import torch

import speedflags
from speedflags import fast_math
from speedflags.errors import AbandonedFrameWarning, LedgerOrderError


def in_thread(target: Any) -> None:
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


def test_a_block_left_open_by_a_thread_that_ended_is_restored_at_the_next_boundary() -> None:
    spec = fast_math(cudnn_benchmark=True, amp="bf16", device="cpu", label="left open")
    in_thread(spec.__enter__)  # the thread ends without exiting
    assert torch.backends.cudnn.benchmark  # a process-wide flag, pinned by nobody now
    assert len(speedflags.ledger().open_frames()) == 1
    with pytest.warns(AbandonedFrameWarning, match=r"'left open'.*was still open when thread"):
        with fast_math(matmul_precision="highest", device="cpu"):  # any boundary
            assert not torch.backends.cudnn.benchmark
    assert not speedflags.ledger().open_frames()
    notes = [r.reason for r in speedflags.ledger().history if r.label == "left open"]
    assert any("abandoned: thread" in note for note in notes)  # the audit trail says so
    assert any("thread-local state, ended with its thread" in note for note in notes)


def test_an_abandoned_block_under_a_live_one_keeps_the_live_ones_value() -> None:
    spec = fast_math(cudnn_benchmark=True, device="cpu", label="left open")
    live = fast_math(cudnn_benchmark=False, device="cpu", label="live")
    ready, release = threading.Event(), threading.Event()

    def hold_then_end() -> None:
        spec.__enter__()
        ready.set()
        release.wait(10)

    thread = threading.Thread(target=hold_then_end)
    thread.start()
    ready.wait(10)
    with pytest.warns(speedflags.LeverConflictWarning):
        live.__enter__()  # above the other thread's block on the same stack
    release.set()
    thread.join(10)
    with pytest.warns(AbandonedFrameWarning):
        with fast_math(matmul_precision="highest", device="cpu"):
            assert not torch.backends.cudnn.benchmark  # the live block's value holds
    live.__exit__(None, None, None)
    assert not torch.backends.cudnn.benchmark
    assert not speedflags.ledger().open_frames()


def test_a_block_exited_from_another_thread_stays_open_for_its_own() -> None:
    spec = fast_math(cudnn_benchmark=True, device="cpu", label="mine")
    entered, exit_now, errors = threading.Event(), threading.Event(), []

    def owner() -> None:
        spec.__enter__()
        entered.set()
        exit_now.wait(10)
        spec.__exit__(None, None, None)

    thread = threading.Thread(target=owner)
    thread.start()
    entered.wait(10)
    frame = speedflags.ledger().open_frames()[0]
    with pytest.raises(LedgerOrderError, match=r"stays open for thread .* to exit") as info:
        speedflags.ledger().close(frame)
    errors.append(info.value)
    assert torch.backends.cudnn.benchmark  # nothing was restored
    exit_now.set()
    thread.join(10)
    assert not torch.backends.cudnn.benchmark  # its own thread exited it
    assert not speedflags.ledger().open_frames()


def test_a_block_exited_twice_says_so() -> None:
    spec = fast_math(cudnn_benchmark=True, device="cpu", label="twice")
    with spec:
        pass
    with pytest.raises(LedgerOrderError, match=r"is exited again: its frame 'twice'"):
        spec.__exit__(None, None, None)
    other = fast_math(cudnn_benchmark=True, device="cpu")
    with pytest.raises(LedgerOrderError, match="has no open frame in this thread"):
        other.__exit__(None, None, None)  # never entered at all


# --- fork ------------------------------------------------------------------------------------


def _wait(pid: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") \
                else status >> 8  # fmt: skip
        time.sleep(0.002)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9  # hung


def _child(base: dict[str, Any]) -> int:
    # What a child checks right after the fork: a block enters and exits (the first boundary
    # drops the hammering thread's frame, which does not exist here), then every flag reads
    # as before the hammering began and no frame is open.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fast_math(cudnn_benchmark=True, amp="bf16", device="cpu"):
            if not torch.backends.cudnn.benchmark:
                return 2
    if speedflags.snapshot() != base:
        return 3
    return 0 if not speedflags.ledger().open_frames() else 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_hundred_forks_under_a_hammering_thread_all_get_a_usable_ledger() -> None:
    base = speedflags.snapshot()
    stop = threading.Event()
    spec = fast_math(tf32=True, cudnn_benchmark=True, amp="bf16", device="cpu", label="hammer")

    def hammer() -> None:
        while not stop.is_set():
            with spec:
                pass

    thread = threading.Thread(target=hammer)
    thread.start()
    codes: list[int] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
            for _ in range(100):
                pid = os.fork()
                if pid == 0:  # the child: never returns into pytest
                    code = 1
                    try:
                        code = _child(base)
                    finally:
                        os._exit(code)
                codes.append(_wait(pid, 30))
    finally:
        stop.set()
        thread.join(10)
    assert codes == [0] * 100, codes
    assert speedflags.snapshot() == base
