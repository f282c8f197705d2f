"""speedflags._measure.timing: the synchronising clock, rotation past the cache, round planning.

The CUDA paths are checked with a faked ``torch.cuda.synchronize`` (a CPU build has no GPU
to wait for): what is checked is *that* and *when* the device is waited for.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from speedflags._measure import timing
from speedflags._measure.timing import (
    Timing,
    plan_calls,
    plan_rounds,
    rotation_sets,
    synced,
    timer_for,
)

MiB = 2**20


@pytest.fixture
def sync_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record torch.cuda.synchronize calls (faked: this build has no GPU)."""
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_cpu_clock_is_plain_perf_counter() -> None:
    assert timer_for(torch.device("cpu")) is time.perf_counter


def test_cuda_clock_waits_for_the_device_before_reading(sync_calls: list[object]) -> None:
    device = torch.device("cuda", 1)
    clock = timer_for(device)
    first = clock()
    second = clock()
    assert sync_calls == [device, device]
    assert second >= first
    assert "cuda1" in clock.__name__


def test_synced_waits_after_the_call(sync_calls: list[object]) -> None:
    order: list[str] = []

    def work(x: int) -> int:
        order.append(f"work {len(sync_calls)} syncs so far")
        return x + 1

    assert synced(work, torch.device("cuda"))(1) == 2
    assert order == ["work 0 syncs so far"]
    assert sync_calls == [torch.device("cuda")]


def test_synced_on_cpu_never_touches_cuda(sync_calls: list[object]) -> None:
    assert synced(lambda: 3, torch.device("cpu"))() == 3
    assert sync_calls == []


def test_timer_sync_waits_only_where_cuda_is_in_use(sync_calls: list[object]) -> None:
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    assert timing.timer_sync() > 0
    # on a CPU (or a GPU machine whose CUDA nobody initialised yet) it never touches CUDA
    assert sync_calls == ([None] if in_use else [])
    assert torch.cuda.is_initialized() is in_use  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    ("set_bytes", "cache", "expected"),
    [
        (8 * MiB, 32 * MiB, 9),  # (9 - 1) * 8 MiB = 64 MiB = twice the cache
        (16 * MiB, 32 * MiB, 5),
        (64 * MiB, 32 * MiB, 1),  # already twice the cache: one set
        (512 * MiB, 50 * MiB, 1),
        (1024, 32 * MiB, 64),  # tiny sets: capped at 64
        (0, 32 * MiB, 1),
    ],
)
def test_rotation_sets(set_bytes: int, cache: int, expected: int) -> None:
    assert rotation_sets(set_bytes, cache) == expected


def test_rotation_respects_the_memory_budget() -> None:
    assert rotation_sets(100 * MiB, cache=1024 * MiB, budget=300 * MiB) == 3


def test_cpu_cache_size_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, size in ((0, "48K"), (2, "1024K"), (3, "32768K")):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "size").write_text(size + "\n")
    assert timing._cpu_cache_bytes(str(tmp_path)) == 32 * MiB
    assert timing._cpu_cache_bytes(str(tmp_path / "missing")) == 0


@pytest.mark.parametrize(
    ("text", "expected"), [("32768K", 32 * MiB), ("2M", 2 * MiB), ("1G", 2**30), ("x", 0)]
)
def test_parse_size(text: str, expected: int) -> None:
    assert timing._parse_size(text) == expected


def test_cuda_cache_size_is_the_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:  # what an H100 reports (faked: no GPU here)
        L2_cache_size = 50 * MiB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert timing.cache_bytes(torch.device("cuda")) == 50 * MiB


def test_this_machines_cpu_cache_is_found() -> None:
    assert timing.cache_bytes(torch.device("cpu")) >= 256 * 1024


@pytest.mark.parametrize(
    ("estimate", "expected"),
    [(0.19, 6), (0.0014, 715), (2.0, 5), (1e-7, 1000), (0.0, 1000)],
)
def test_plan_rounds(estimate: float, expected: int) -> None:
    assert plan_rounds(estimate, min_rounds=5, min_time_s=1.0) == expected


@pytest.mark.parametrize(
    ("estimate", "device", "expected"),
    [
        (85e-6, "cuda", 12),  # a 85 us kernel: 12 calls fill a millisecond
        (0.0014, "cuda", 1),
        (1e-9, "cuda", 100),  # capped
        (85e-6, "cpu", 1),  # reading a CPU clock costs nothing
    ],
)
def test_plan_calls(estimate: float, device: str, expected: int) -> None:
    assert plan_calls(estimate, torch.device(device)) == expected


def test_timing_pools_passes_and_keeps_their_medians() -> None:
    t = Timing.of([[3.0, 1.0, 2.0], [], [10.0]])
    assert t.times == (3.0, 1.0, 2.0, 10.0)
    assert t.rounds == 4
    assert t.median == 2.5
    assert t.pass_medians == (2.0, 10.0)
    assert t.quartiles == (1.75, 4.75)
    assert Timing.of([[1.0]]).quartiles is None
