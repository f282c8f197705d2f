"""Timing done right on CPU and GPU: a synchronising clock, warm-up, rotation past the cache.

CUDA kernels run asynchronously, so a host clock read right after a launch measures the
launch, not the work. Every clock read here first waits for the device's queued work (what
``torch.utils.benchmark``'s timer does), and every timed call ends with a synchronisation,
so the same code is correct on a CPU (where synchronising is a no-op) and on a GPU.

Repeating a call on the same small inputs measures the cache, not memory: inputs are
rotated through enough sets that, between two uses of one set, at least twice the size of
the last-level cache (GPU L2, CPU L3) is touched by the others.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = [
    "MAX_ROUNDS",
    "Timing",
    "cache_bytes",
    "plan_calls",
    "plan_rounds",
    "rotation_sets",
    "synced",
    "synchronize",
    "timer_for",
    "timer_sync",
]

_FALLBACK_CACHE = 32 * 2**20  # a common L3 size, when the system does not say
_ROTATION_BUDGET = 2**30  # at most 1 GiB of extra input sets
_MAX_SETS = 64


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on a CPU).

    Example:
        >>> import torch
        >>> from speedflags._measure.timing import synchronize
        >>> synchronize(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


T = TypeVar("T")


def synced(fn: Callable[..., T], device: torch.device) -> Callable[..., T]:
    """``fn`` followed by :func:`synchronize`: the call returns when the device is done.

    For pytest-benchmark's ``pedantic``, whose clock does not wait for the GPU: wrap both
    the ``setup`` (so its work is done before the clock starts) and the target (so the
    clock stops after the kernels, not after their launch).

    Example:
        >>> import torch
        >>> from speedflags._measure.timing import synced
        >>> synced(torch.mm, torch.device("cpu"))(torch.eye(2), torch.eye(2)).trace().item()
        2.0
    """

    def call(*args: Any, **kwargs: Any) -> T:
        out = fn(*args, **kwargs)
        synchronize(device)
        return out

    return call


def timer_for(device: torch.device) -> Callable[[], float]:
    """A clock (seconds) that first waits for ``device``'s queued work.

    Use it as pytest-benchmark's ``timer``, or read it before and after the timed call.

    Example:
        >>> import torch
        >>> from speedflags._measure.timing import timer_for
        >>> clock = timer_for(torch.device("cpu"))
        >>> start = clock(); elapsed = clock() - start
        >>> elapsed >= 0
        True
    """
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    synced.__name__ = synced.__qualname__ = f"timer_sync_{str(device).replace(':', '')}"
    return synced


def timer_sync() -> float:
    """``time.perf_counter()`` after waiting for the current CUDA device, if CUDA is in use.

    For ``pytest --benchmark-timer=speedflags._measure.timing.timer_sync``: it never initialises
    CUDA itself, so it costs nothing on a CPU-only run.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
    return time.perf_counter()


def cache_bytes(device: torch.device) -> int:
    """The size of ``device``'s last-level cache: the GPU's L2, or the CPU's largest cache.

    Example:
        >>> import torch
        >>> from speedflags._measure.timing import cache_bytes
        >>> cache_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        size = int(getattr(props, "L2_cache_size", 0) or 0)
        return size or _FALLBACK_CACHE
    return _cpu_cache_bytes() or _FALLBACK_CACHE


def _cpu_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    largest = 0
    for index in range(8):
        try:
            with open(f"{root}/index{index}/size", encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        largest = max(largest, _parse_size(text))
    return largest


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    if text and text[-1] in units:
        number, scale = text[:-1], units[text[-1]]
    else:
        number, scale = text, 1
    try:
        return int(number) * scale
    except ValueError:
        return 0


def rotation_sets(set_bytes: int, cache: int, budget: int = _ROTATION_BUDGET) -> int:
    """How many input sets to rotate through so that no call finds its inputs in the cache.

    Between two uses of one set, the others touch at least twice ``cache`` bytes (bounded by
    ``budget`` bytes of inputs in all, and 64 sets).

    Example:
        >>> from speedflags._measure.timing import rotation_sets
        >>> MiB = 2**20
        >>> rotation_sets(8 * MiB, cache=32 * MiB)  # 8 MiB sets, 32 MiB L3: 9 sets
        9
        >>> rotation_sets(512 * MiB, cache=50 * MiB)  # larger than the cache: no rotation
        1
    """
    if set_bytes <= 0:
        return 1
    if set_bytes >= 2 * cache:
        return 1
    wanted = math.ceil(2 * cache / set_bytes) + 1
    return max(1, min(wanted, budget // set_bytes, _MAX_SETS))


MAX_ROUNDS = 1000  # timed rounds per configuration and pass: --min-time stops here


def plan_rounds(
    estimate_s: float, min_rounds: int, min_time_s: float, max_rounds: int = MAX_ROUNDS
) -> int:
    """Timed rounds for one configuration: at least ``min_rounds`` and ``min_time_s`` seconds.

    Example:
        >>> from speedflags._measure.timing import plan_rounds
        >>> plan_rounds(0.19, min_rounds=5, min_time_s=1.0)   # a 190 ms matmul
        6
        >>> plan_rounds(0.0014, min_rounds=5, min_time_s=1.0)  # a 1.4 ms GPU matmul
        715
    """
    if estimate_s <= 0:
        return max_rounds
    return max(min_rounds, min(max_rounds, math.ceil(min_time_s / estimate_s)))


def plan_calls(estimate_s: float, device: torch.device, round_s: float = 1e-3) -> int:
    """Calls per timed round: on a GPU, enough to fill ``round_s`` between two synchronisations.

    A synchronisation costs 5 to 20 us, which would distort kernels under a millisecond;
    several calls (each on its own input set) between two clock reads make it negligible.
    On a CPU the clock costs nothing to read: one call per round.

    Example:
        >>> import torch
        >>> from speedflags._measure.timing import plan_calls
        >>> plan_calls(85e-6, torch.device("cuda")), plan_calls(85e-6, torch.device("cpu"))
        (12, 1)
        >>> plan_calls(0.0014, torch.device("cuda"))
        1
    """
    if device.type != "cuda" or estimate_s >= round_s:
        return 1
    return min(100, math.ceil(round_s / max(estimate_s, 1e-9)))


@dataclass(frozen=True)
class Timing:
    """Per-call times of one configuration, pooled over its passes (seconds).

    Example:
        >>> from speedflags._measure.timing import Timing
        >>> t = Timing.of([[0.3, 0.1, 0.2], [0.25, 0.2]])
        >>> t.median, t.rounds, t.pass_medians
        (0.2, 5, (0.2, 0.225))
    """

    times: Sequence[float]
    pass_medians: Sequence[float]

    @classmethod
    def of(cls, passes: Sequence[Sequence[float]]) -> Timing:
        done = [list(p) for p in passes if p]
        pooled: list[float] = [t for p in done for t in p]
        return cls(tuple(pooled), tuple(statistics.median(p) for p in done))

    @property
    def rounds(self) -> int:
        return len(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def quartiles(self) -> tuple[float, float] | None:
        """(25th, 75th) percentile, or None with fewer than two rounds."""
        if len(self.times) < 2:
            return None
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q[0], q[2])
