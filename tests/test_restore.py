"""Behaviour 1: after any block snapshot() is what it was before; the exception is untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import speedflags
from speedflags import fast_math

EVERY_LEVER: dict[str, Any] = dict(
    tf32=True,
    matmul_precision="medium",
    cudnn_benchmark=True,
    sdpa=("math", "flash"),
    amp="bf16",
    device="cpu",
)


def test_normal_exit_restores_everything() -> None:
    before = speedflags.snapshot()
    with fast_math(**EVERY_LEVER):
        assert speedflags.snapshot() != before
    assert speedflags.snapshot() == before


class Boom(Exception):
    pass


def test_exception_propagates_unchanged_and_everything_is_restored() -> None:
    before = speedflags.snapshot()
    error = Boom("inside")
    with pytest.raises(Boom) as excinfo, fast_math(**EVERY_LEVER):
        raise error
    assert excinfo.value is error
    assert excinfo.value.__context__ is None  # speedflags added nothing to the chain
    assert speedflags.snapshot() == before


def test_keyboard_interrupt_restores_everything() -> None:
    before = speedflags.snapshot()
    with pytest.raises(KeyboardInterrupt), fast_math(**EVERY_LEVER):
        raise KeyboardInterrupt
    assert speedflags.snapshot() == before


def test_nested_blocks_restore_each_level() -> None:
    outer_before = speedflags.snapshot()
    with fast_math(tf32=True, amp="bf16", device="cpu"):
        middle = speedflags.snapshot()
        with fast_math(tf32=False, cudnn_benchmark=True, amp=False, device="cpu"):
            inner = speedflags.snapshot()
            with fast_math(matmul_precision="medium", sdpa="math"):
                pass
            assert speedflags.snapshot() == inner
        assert speedflags.snapshot() == middle
    assert speedflags.snapshot() == outer_before


def test_one_spec_is_reusable_and_reentrant() -> None:
    spec = fast_math(tf32=True, cudnn_benchmark=True)
    before = speedflags.snapshot()
    for _ in range(3):
        with spec:
            inside = speedflags.snapshot()
            with spec:  # re-entered while already open
                assert speedflags.snapshot() == inside
            assert speedflags.snapshot() == inside
    assert speedflags.snapshot() == before


def test_exception_in_nested_block_restores_all_levels() -> None:
    before = speedflags.snapshot()
    with pytest.raises(Boom), fast_math(tf32=True, device="cpu"):
        with fast_math(matmul_precision="high", amp="bf16", device="cpu"):
            with fast_math(cudnn_benchmark=True):
                raise Boom
    assert speedflags.snapshot() == before


def test_creating_a_spec_touches_nothing() -> None:
    before = speedflags.snapshot()
    history = len(speedflags.ledger().history)
    fast_math(**EVERY_LEVER)
    fast_math()
    speedflags.tf32()
    speedflags.autocast("bf16", device="cpu")
    assert speedflags.snapshot() == before
    assert len(speedflags.ledger().history) == history


def test_frame_reports_what_was_applied() -> None:
    with fast_math(tf32=True, amp="bf16", device="cpu") as frame:
        assert frame.levers == ("tf32", "amp")
        assert frame.values == {"tf32": True, "amp": "bfloat16"}
        assert frame.device == "cpu"
        assert not frame.closed
    assert frame.closed


def test_result_of_matmul_is_bf16_inside_amp_block() -> None:
    a = torch.randn(8, 8)
    with fast_math(amp="bf16", device="cpu"):
        assert (a @ a).dtype == torch.bfloat16
    assert (a @ a).dtype == torch.float32


def test_blocks_entered_again_replay_writes_only_from_the_state_they_were_made_from(
    raw_tf32: None,
) -> None:
    # The TF32 family's levers replay the last write made from the same state (the hot path);
    # a state changed between blocks, or inside one, takes a write of its own.
    spec = fast_math(tf32=True)
    before = speedflags.snapshot()
    inside = []
    for _ in range(3):
        with spec:
            inside.append(speedflags.snapshot())
        assert speedflags.snapshot() == before
    assert inside[0]["tf32"]["torch.get_float32_matmul_precision()"] == "high"
    assert inside[1:] == inside[:-1]
    torch.set_float32_matmul_precision("medium")  # changed between blocks
    medium = speedflags.snapshot()
    with spec:  # tf32=True keeps a precision that allows TF32 already
        assert speedflags.snapshot()["tf32"]["torch.get_float32_matmul_precision()"] == "medium"
    assert speedflags.snapshot() == medium
    with pytest.warns(speedflags.DriftWarning, match="tf32"), spec:
        torch.backends.cuda.matmul.allow_tf32 = False  # changed inside the block
    assert speedflags.snapshot() == medium
