"""What an emulated lever costs: a small matmul timed with and without it, interleaved.

The matmul is a bias-free ``Linear`` layer's forward, the model a model lever
(``param_dtype``) acts on; autocast computes it as the plain matmul it is. For ``fp8`` the
layer is a ``Linear(2048, 2048)`` (the smallest the size rule converts) in a ``Sequential``
(a layer is swapped in its parent), at 16 rows.

bf16 or fp16 autocast on a CPU without the instructions for the dtype computes in the dtype
(its output and its error say so) at a fraction of fp32's speed. ``verify`` gives such a
lever the verdict "in effect, emulated: slower" with the factor :func:`slowdown` measured: a
256x256 float32 matmul (1024x1024 on CUDA) in the baseline frame and in the lever's frame,
each warmed up, then timed round by round in turn (baseline, lever, baseline, ...) so that a
neighbour's load hits both alike, on one CPU thread (with two, on a shared 2-core machine,
OpenMP's barriers made an fp32 matmul 60 times slower than on a quiet one, and the factor
read 4x where it is 50x; the thread count is put back after). Each side's fastest round is
kept: a neighbour only adds time. Measured once per process, device and lever set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._locks import new_lock
from .._warn import measuring
from .configs import Config
from .evidence import inputs
from .timing import timer_for

__all__ = ["Slowdown", "slowdown"]

MATMUL_N = {"cpu": 256, "cuda": 1024}
FP8_ROWS = 16  # fp8's layer: Linear(2048, 2048) in a Sequential, the smallest it converts
ROUNDS = 5


class Slowdown(NamedTuple):
    """The baseline's median time over the lever's (below 1: slower), and how it was timed."""

    factor: float
    how: str


_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Slowdown] = {}
_lock = new_lock()


def slowdown(levers: Mapping[str, Any], device: torch.device) -> Slowdown:
    """Time a small float32 matmul in the baseline frame and under ``levers``, interleaved.

    Scope: opens ``fast_math`` frames on top of the baseline (process-wide levers, the
    calling thread's autocast), each restoring what it set; no warning is said for the
    levers (they are entered on purpose). On a CPU it runs with one intra-op thread
    (``torch.set_num_threads``, put back after: a running watch records both writes).

    Example:
        >>> import torch
        >>> from speedflags._measure.emulation import slowdown
        >>> found = slowdown({"amp": "bf16"}, torch.device("cpu"))
        >>> found.factor > 0, found.how
        (True, 'a 256x256 matmul, 1 thread, 5 interleaved rounds')
    """
    key = (str(device), tuple(sorted((k, str(v)) for k, v in levers.items())))
    found = _cache.get(key)
    if found is None:
        with _lock:
            found = _cache.get(key)
            if found is None:
                found = _cache[key] = _measure(levers, device)
    return found


def _measure(levers: Mapping[str, Any], device: torch.device) -> Slowdown:
    n = MATMUL_N.get(device.type, 256)
    rows, shape = n, f"{n}x{n}"
    torch.manual_seed(0)
    if "fp8" in levers:  # a layer the size rule converts, held by a parent that swaps it
        from ..levers._fp8_swap import MIN_FEATURES

        n, rows = MIN_FEATURES, FP8_ROWS
        shape = f"{rows}x{n} by {n}x{n}"
        layer: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False))
    else:
        layer = torch.nn.Linear(n, n, bias=False)
    layer = layer.to(device)
    (a,) = inputs([(rows, n)], device)
    clock = timer_for(device)
    configs = (Config("baseline", {}, baseline=True), Config("lever", dict(levers)))
    times: dict[str, list[float]] = {config.name: [] for config in configs}

    def once(config: Config) -> float:
        with config.frames(device, layer), torch.no_grad():
            start = clock()
            layer(a)
            return clock() - start

    threads = torch.get_num_threads()
    one = device.type == "cpu" and threads != 1
    if one:
        torch.set_num_threads(1)
    try:
        with measuring():
            for config in configs:  # a warm-up of its own for each
                once(config)
            for _ in range(ROUNDS):
                for config in configs:
                    times[config.name].append(once(config))
    finally:
        if one:
            torch.set_num_threads(threads)
    factor = min(times["baseline"]) / min(times["lever"])
    thread = ", 1 thread" if device.type == "cpu" else ""
    return Slowdown(factor, f"a {shape} matmul{thread}, {ROUNDS} interleaved rounds")
