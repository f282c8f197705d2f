"""How long a ``bench`` run will take, said before it starts.

A timed call is estimated from its floating-point operations (``Workload.flops``), at the
rate this device runs float32 matmuls now plus a fixed cost per call (on a busy CPU,
milliseconds of threads waiting to be scheduled), both measured before the run on two
matmul sizes in a fraction of a second (:func:`calibrate`), and from the run's own plan: for
each workload and size, the float64 reference and, for each configuration the run measures
(those it skips, it skips here too), its error call, its warm-up and its timed rounds in
every pass. The rounds are sized from the fastest call, as the run sizes them
(:func:`~speedflags._measure.timing.plan_rounds`), and each takes a typical call: on a busy
machine the median call is several times the fastest, and so is the run. The emulated
configurations' group, at a small size, is counted at :data:`EMULATED_COST` times fp32.

It is an estimate: configurations faster than fp32 make the run shorter, work that is far
from a matmul's rate (weight-bound inference, attention's softmax) longer. The run says how
long it took at the end, beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._fast_math import fast_math
from .._measure.configs import BASELINE_LEVERS, Config
from .._measure.timing import plan_calls, plan_rounds, timer_for
from .._measure.workloads import Workload

__all__ = [
    "EMULATED_COST",
    "ONCE_ROUNDS",
    "Calibration",
    "CallModel",
    "calibrate",
    "duration",
    "seconds",
]

EMULATED_COST = 50.0  # an emulated call, in fp32 calls: tens of times slower on the CPUs measured
ONCE_ROUNDS = 3  # the timed rounds of an emulated configuration (as the runner's)
REFERENCE_COST = 4.0  # the float64 reference, in fp32 calls
VERIFY_S = 1.0  # the verdicts recorded before the run (speedflags.verify of its levers)
_FLOOR_S = 2e-5  # a call's overhead, whatever its operations: Python, the frames, a launch


@dataclass(frozen=True)
class CallModel:
    """A call's time on a device now: a fixed ``latency`` (launching it, its threads waking
    up: milliseconds on a busy CPU) plus its operations at ``rate`` per second.

    Example:
        >>> from speedflags.bench.estimate import CallModel
        >>> CallModel(latency=1e-3, rate=1e11).seconds(2e9)
        0.021
    """

    latency: float
    rate: float

    def seconds(self, flops: float) -> float:
        return self.latency + flops / self.rate

    @classmethod
    def through(cls, small: tuple[float, float], large: tuple[float, float]) -> CallModel:
        """The model through two ``(flops, seconds)`` points (the rate of the larger alone
        where it was no slower: the machine changed between the two)."""
        (f_small, s_small), (f_large, s_large) = small, large
        rate = (f_large - f_small) / max(s_large - s_small, 1e-12)
        if s_large <= s_small:
            rate = f_large / max(s_large, 1e-12)
        return cls(max(s_small - f_small / rate, 0.0), rate)

    def __str__(self) -> str:
        return f"{self.rate / 1e9:.3g} GFLOP/s and {self.latency * 1e3:.2g} ms a call"


@dataclass(frozen=True)
class Calibration:
    """How long calls take on a device now: the ``fastest`` (what the run sizes its rounds
    from: its warm-up's fastest call) and the ``typical`` (the median: what they take, a
    neighbour's load included)."""

    fastest: CallModel
    typical: CallModel

    def __str__(self) -> str:
        return str(self.typical)


def calibrate(device: torch.device) -> Calibration:
    """How long calls take on ``device`` now (:class:`Calibration`), from two float32
    matmuls (TF32 off, as the baseline runs): 256 and 1024 on a CPU, 1024 and 4096 on a
    GPU, seven timed calls each after two warm-up calls.

    Example:
        >>> import torch
        >>> from speedflags.bench.estimate import calibrate
        >>> found = calibrate(torch.device("cpu"))
        >>> found.typical.rate > 1e6 and found.typical.latency >= 0
        True
    """
    sizes = (1024, 4096) if device.type == "cuda" else (256, 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    clock = timer_for(device)
    fastest, typical = [], []
    with fast_math(**BASELINE_LEVERS, device=str(device), label="speedflags bench estimate"):
        for n in sizes:
            a = torch.randn(n, n, generator=gen, device=device)
            b = torch.randn(n, n, generator=gen, device=device)
            for _ in range(2):
                torch.mm(a, b)
            times = []
            for _ in range(7):
                start = clock()
                torch.mm(a, b)
                times.append(clock() - start)
            fastest.append((2.0 * n**3, min(times)))
            typical.append((2.0 * n**3, statistics.median(times)))
    return Calibration(CallModel.through(*fastest), CallModel.through(*typical))


def _measured(workload: Workload, configs: Sequence[Config], device: torch.device) -> int:
    # the configurations the run times at full size: as it decides, before building anything
    count = 0
    for config in configs:
        if config.baseline:
            count += 1
        elif config.identical_to_baseline() or config.unavailable(device) is not None:
            continue
        elif workload.same_as_another(config, device, configs) is None:
            count += 1
    return count


def _emulated(workload: Workload, configs: Sequence[Config], device: torch.device) -> int:
    return sum(
        1
        for config in configs
        if config.emulated(device) and workload.same_as_another(config, device, configs) is None
    )


def seconds(
    plan: Sequence[tuple[Workload, int | None]],
    configs_of: dict[str, Sequence[Config]],
    device: torch.device,
    calibration: Calibration,
    *,
    passes: int,
    min_rounds: int,
    min_time_s: float,
    warmup_rounds: int,
    warmup_s: float,
    emulated_size: int,
    verify: bool = True,
) -> float:
    """The estimated seconds of a run of ``plan`` (``(workload, size)`` pairs, size None for
    a workload the device lacks) comparing ``configs_of[workload.name]``, each call taking
    what ``calibration`` says; the other arguments are the run's settings.

    Example:
        >>> import torch
        >>> from speedflags._measure.workloads import WORKLOADS
        >>> from speedflags.bench.estimate import Calibration, CallModel, seconds
        >>> matmul = WORKLOADS["matmul"]
        >>> plan, configs = [(matmul, 1024)], {"matmul": matmul.configs}
        >>> settings = dict(min_rounds=5, min_time_s=0.25, warmup_rounds=2, warmup_s=0.1,
        ...                 emulated_size=256, verify=False)
        >>> model = CallModel(latency=0.0, rate=1e11)
        >>> now = Calibration(model, model)
        >>> one = seconds(plan, configs, torch.device("cpu"), now, passes=1, **settings)
        >>> three = seconds(plan, configs, torch.device("cpu"), now, passes=3, **settings)
        >>> one < three < 3 * one  # the first pass also warms up
        True
    """

    def calls_of(workload: Workload, size: int) -> tuple[float, float]:
        flops = workload.flops(size, device.type)
        fast = max(calibration.fastest.seconds(flops), _FLOOR_S)
        return fast, max(calibration.typical.seconds(flops), fast)

    def group(workload: Workload, size: int, measured: int) -> float:
        fast, call = calls_of(workload, size)
        calls = plan_calls(fast, device)
        # rounds sized from the fastest call, as the run sizes them; each takes a typical one
        timed = plan_rounds(fast * calls, min_rounds, min_time_s) * calls * call
        first = call + max(warmup_rounds * call, warmup_s) + timed  # error, warm-up, rounds
        return REFERENCE_COST * call + measured * (first + (passes - 1) * (call + timed))

    def once(workload: Workload, size: int, emulated: int) -> float:
        # the emulated group: the baseline and each emulated one, an error call, a warm-up
        # call and a few rounds each
        _, call = calls_of(workload, size)
        calls = 2 + min(min_rounds, ONCE_ROUNDS)
        return REFERENCE_COST * call + calls * call * (1 + emulated * EMULATED_COST)

    total = VERIFY_S if verify else 0.0
    emulated: dict[str, tuple[Workload, int]] = {}
    for workload, size in plan:
        if size is None or workload.too_big(size, device) is not None:
            continue
        configs = configs_of[workload.name]
        total += group(workload, size, _measured(workload, configs, device))
        found = _emulated(workload, configs, device)
        if found:
            emulated[workload.name] = (workload, found)
    for workload, found in emulated.values():
        size = min(emulated_size, *(s for w, s in plan if w is workload and s is not None))
        total += once(workload, size, found)
    return total


def duration(seconds: float) -> str:
    """``seconds`` in words: ``"45 s"``, ``"6 min"``, ``"1.5 h"``.

    Example:
        >>> from speedflags.bench.estimate import duration
        >>> duration(44.6), duration(346), duration(5400)
        ('45 s', '6 min', '1.5 h')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.2g} h"
