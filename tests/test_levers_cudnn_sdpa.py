"""Behaviours 5 and 6.

cudnn_benchmark touches one flag; SDPA preferences restore exactly and never crash.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import C, needs_sdpa_kernel

import speedflags
from speedflags import fast_math

HAS_ORDER = hasattr(C, "_get_sdp_priority_order")
needs_order = pytest.mark.skipif(
    not HAS_ORDER, reason=f"PyTorch {torch.__version__} has no SDPA priority order"
)


def cudnn_neighbours() -> tuple[Any, ...]:
    return (
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )


# --- behaviour 5 -------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [False, True])
def test_cudnn_benchmark_changes_only_benchmark(start: bool) -> None:
    torch.backends.cudnn.benchmark = start
    try:
        neighbours = cudnn_neighbours()
        with speedflags.cudnn_benchmark():
            assert torch.backends.cudnn.benchmark is True
            assert cudnn_neighbours() == neighbours
        with fast_math(cudnn_benchmark=False):
            assert torch.backends.cudnn.benchmark is False
            assert cudnn_neighbours() == neighbours
        assert torch.backends.cudnn.benchmark is start
    finally:
        torch.backends.cudnn.benchmark = False


def test_pytorchs_own_cudnn_flags_would_switch_cudnn_off() -> None:
    # The trap speedflags avoids: flags(benchmark=True) also applies enabled=False.
    with torch.backends.cudnn.flags(benchmark=True):
        assert torch.backends.cudnn.enabled is False
    with speedflags.cudnn_benchmark():
        assert torch.backends.cudnn.enabled is True


# --- behaviour 6 -------------------------------------------------------------------------------


def sdpa_flags() -> tuple[Any, ...]:
    names = ("flash", "mem_efficient", "math", "cudnn")
    flags = tuple(
        getattr(C, f"_get_{n}_sdp_enabled")() for n in names if hasattr(C, f"_get_{n}_sdp_enabled")
    )
    order = tuple(C._get_sdp_priority_order()) if HAS_ORDER else ()
    return flags, order


@needs_order
def test_preference_sets_flags_and_order() -> None:
    with fast_math(sdpa=("cudnn", "flash")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()  # the fallback stays
        assert list(C._get_sdp_priority_order())[:3] == [3, 1, 0]  # cudnn, flash, math


@needs_order
@pytest.mark.parametrize(
    "start_order",
    [[1, 2, 0, 3, 4], [3, 0, 4, 2, 1], [0, 1, 2, 3, 4]],
    ids=["default", "odd", "math-first"],
)
@pytest.mark.parametrize(
    "disabled", [(), ("flash",), ("mem_efficient", "cudnn")], ids=["none", "flash", "eff+cudnn"]
)
def test_flags_and_priority_order_come_back_exactly(
    start_order: list[int], disabled: tuple[str, ...]
) -> None:
    original = list(C._get_sdp_priority_order())
    C._set_sdp_priority_order(start_order)
    for name in disabled:
        getattr(C, f"_set_sdp_use_{name}")(False)
    try:
        before = sdpa_flags()
        for preference in (
            "flash",
            ("efficient", "math"),
            ("math",),
            ("cudnn", "efficient", "flash"),
        ):
            with fast_math(sdpa=preference):
                pass
            assert sdpa_flags() == before
    finally:
        for name in disabled:
            getattr(C, f"_set_sdp_use_{name}")(True)
        C._set_sdp_priority_order(original)


@needs_order
def test_pytorchs_sdpa_kernel_with_set_priority_loses_the_order() -> None:
    # Why speedflags snapshots the order itself: with a backend disabled on entry,
    # sdpa_kernel(set_priority=True) does not put the order back.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    original = list(C._get_sdp_priority_order())
    C._set_sdp_use_flash(False)
    try:
        with sdpa_kernel([SDPBackend.MATH], set_priority=True):
            pass
        lost = list(C._get_sdp_priority_order()) != original
        C._set_sdp_priority_order(original)
        with fast_math(sdpa="math"):
            pass
        assert list(C._get_sdp_priority_order()) == original
    finally:
        C._set_sdp_use_flash(True)
        C._set_sdp_priority_order(original)
    assert lost, "PyTorch now restores the order itself; docs/guarantees.md's claim needs updating"


def attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("preference", ["efficient", "cudnn", "flash", ("cudnn", "efficient")])
def test_a_preference_never_becomes_no_available_kernel(preference: Any) -> None:
    q, k, v = attention_inputs()
    expected = F.scaled_dot_product_attention(q, k, v)
    with fast_math(sdpa=preference):
        got = F.scaled_dot_product_attention(q, k, v)  # CPU: efficient/cudnn cannot run here
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@needs_sdpa_kernel
def test_an_exclusive_sdpa_kernel_would_crash_where_speedflags_falls_back() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = attention_inputs()
    with pytest.raises(RuntimeError, match=r"No viable backend|No available kernel"):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)
    with speedflags.sdpa_backend("efficient"):
        F.scaled_dot_product_attention(q, k, v)


def test_sdpa_record_explains_a_preference_that_cannot_run_here() -> None:
    with fast_math(sdpa="efficient", device="cpu"):
        pass
    record = [r for r in speedflags.ledger().history if r.lever == "sdpa"][-2]
    assert record.action == "set"
    assert "cannot run on cpu" in record.reason


@pytest.mark.skipif(HAS_ORDER, reason=f"PyTorch {torch.__version__} has an SDPA priority order")
def test_a_pytorch_without_a_priority_order_says_so_in_the_record() -> None:
    before = sdpa_flags()
    with fast_math(sdpa=("efficient", "flash"), device="cpu"):
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert sdpa_flags() == before
    record = [r for r in speedflags.ledger().history if r.lever == "sdpa"][-2]
    assert record.action == "set"
    assert f"PyTorch {torch.__version__} has no SDPA priority order" in record.reason
    assert record.after["priority"] is None
