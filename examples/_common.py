"""What the examples share: lever arguments, interleaved timing, the speedup line, and the
check that every flag ends as it began (``speedflags.snapshot()`` before and after).

The two configurations (plain fp32, then the levers) are timed in interleaved passes (fp32,
levers, fp32, levers, ...), each pass after a warm-up step of its own, so that the one-time
costs (the allocator, oneDNN's primitive cache, cuDNN's autotuning) and a neighbour's load hit
both alike. The speedup is the geometric mean of the per-pass ratios, printed with its noise,
and each time printed beside it is the geometric mean of its passes: one estimator, so the
speedup is always the ratio of the two times shown. A difference within that noise is said
to be one, and levers that change nothing on the device (or no levers at all) get words,
not a figure. Progress estimates come from timed steps, never from a warm-up step (which
pays the one-time costs)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import speedflags
from speedflags._measure.configs import Config
from speedflags._measure.noise import paired, within_noise
from speedflags._measure.vocabulary import (
    EMULATED,
    NO_EFFECT,
    nothing_changes,
    phrase,
    verdicts_here,
)
from speedflags.levers.lever_sets import baseline_levers
from speedflags.levers.registry import LEVER_NAMES

# Plain fp32: TF32 off, matmul precision "highest", no autocast, no cuDNN benchmark.
FP32: dict[str, Any] = baseline_levers()


def parse_levers(text: str) -> dict[str, Any]:
    """``"tf32=true,amp=bf16,sdpa=flash+math"`` -> ``fast_math`` keyword arguments."""
    levers: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in LEVER_NAMES:
            raise argparse.ArgumentTypeError(
                f"--levers {item!r}: expected name=value with a name among {', '.join(LEVER_NAMES)}"
            )
        word = value.strip().lower()
        if word in ("true", "false"):
            levers[name] = word == "true"
        elif "+" in value:
            levers[name] = tuple(value.split("+"))
        else:
            levers[name] = value.strip()
    speedflags.fast_math(**levers)  # validate now, with speedflags' own error message
    return levers


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on a CPU, for CI (tens of seconds)"
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=None,
        help=f"interleaved passes of each configuration (default {PASSES}; --smoke: "
        f"{SMOKE_PASSES}); at least 3, so that the noise is known",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--levers",
        type=parse_levers,
        default=None,
        help="fast_math levers, e.g. tf32=true,amp=bf16 (default: the recommended ones)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="take the levers from a bench file (its first configuration with levers other "
        "than the baseline), as `speedflags bench --config FILE` compares them",
    )


def pick_device(name: str | None, smoke: bool) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    return torch.device(name)


def chosen_levers(
    given: dict[str, Any] | None,
    device: torch.device,
    config: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The levers to compare with fp32: as given, from a bench file, or the recommended ones."""
    if given is not None and config is not None:
        raise SystemExit("give --levers or --config, not both")
    if config is not None:
        return config_levers(config)
    if given is not None:
        return dict(given)
    return {**speedflags.recommended(device).levers, **extra}


def config_levers(path: str) -> dict[str, Any]:
    """The first configuration of a bench file (or tune lever file) that sets levers and is
    not the baseline; the same file ``speedflags bench --config`` reads."""
    from speedflags.bench.config_file import load_for_cli

    bench, problem = load_for_cli(path)
    if bench is None:
        raise SystemExit(f"--config: {problem}")
    for config in bench.configs:
        if not config.baseline and config.levers and config.dtype is None:
            print(f"levers from {path}: {config.name} = {config.describe()}")
            return dict(config.levers)
    raise SystemExit(f"--config {path!r}: no configuration besides the baseline sets levers")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Progress lines come at most this often (seconds): a full-size run on a CPU takes minutes.
PROGRESS_EVERY_S = 10.0
# The clock of the timings and the progress estimates (tests put a virtual one here).
clock = time.perf_counter


def _duration(seconds: float) -> str:
    if seconds < 0.1:
        return f"{seconds * 1e3:.2g} ms"
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class Progress:
    """What a long run prints: once its first timed step is done, how long the rest should
    take (at that step's pace: the warm-up step before it pays one-time costs, and would
    make the estimate several times too long); then, every ``PROGRESS_EVERY_S`` seconds,
    the step, the loss (when known), the time elapsed and an estimate of what is left.

    ``runs`` counts this run and those still to come, which take about as long (each a
    warm-up step and as many timed steps, at the same pace).
    """

    def __init__(self, name: str, runs: int = 1) -> None:
        self.name = name
        self.runs = runs
        self.start = self.last = self.stepped = clock()
        self.warm_up_s = 0.0

    def first(self, seconds: float, steps: int) -> None:
        """The first (warm-up) step took ``seconds``; ``steps`` timed steps follow."""
        self.warm_up_s = seconds
        self.start = self.last = self.stepped = clock()

    def step(self, done: int, steps: int, loss: Any = None) -> None:
        """``done`` of ``steps`` steps since :meth:`first`; ``loss`` is read only if printed."""
        now = clock()
        if done == 1:
            self._estimate(now - self.stepped, steps)
        if now - self.last < PROGRESS_EVERY_S or done >= steps or done <= 0:
            return
        elapsed = now - self.start
        shown = f", loss {float(loss):.4f}" if loss is not None else ""
        print(
            f"{self.name}: step {done}/{steps}{shown}, {_duration(elapsed)} elapsed, about "
            f"{_duration(elapsed / done * (steps - done))} left",
            flush=True,
        )
        self.last = now

    def _estimate(self, seconds: float, steps: int) -> None:
        # after the first timed step, which took ``seconds``: the rest of this run, and the
        # runs to come, at its pace
        left = seconds * (steps - 1)
        later = seconds * (steps + 1) * (self.runs - 1)  # each: its warm-up step and steps
        more = f"; about {_duration(left + later)} for all {self.runs} runs" * (self.runs > 1)
        print(
            f"{self.name}: warm-up step {_duration(self.warm_up_s)} (one-time costs), then "
            f"{_duration(seconds)} a step: about {_duration(left)} for the {steps - 1} steps "
            f"left{more} (estimated from the first timed step)",
            flush=True,
        )


def seconds_per_step(
    step: Callable[[], Any], steps: int, device: torch.device, name: str = "", runs: int = 1
) -> float:
    """One warm-up step, then the mean time of ``steps`` steps (synchronised on CUDA), with
    :class:`Progress` lines (``step`` may return its loss, read only when printed)."""
    progress = Progress(name, runs)
    start = clock()
    step()
    sync(device)
    progress.first(clock() - start, steps)
    start = clock()
    for i in range(1, steps + 1):
        loss = step()
        if i == 1:
            sync(device)  # the first timed step's time is the estimate's
        progress.step(i, steps, loss)
    sync(device)
    return (clock() - start) / max(steps, 1)


def timed_pass(
    spec: speedflags.FastMath,
    step: Callable[[], Any],
    steps: int,
    device: torch.device,
    left: list[int],
) -> Callable[[str], float]:
    """One pass of one configuration, for :func:`interleaved`: ``step`` under ``spec``, a
    warm-up step then ``steps`` timed steps (:func:`seconds_per_step`). ``left`` holds how
    many passes are left to run, of every configuration (one list shared by them all, for
    the estimate of how long they take): each pass counts itself off."""

    def run(label: str) -> float:
        with spec:
            seconds = seconds_per_step(step, steps, device, label, left[0])
        left[0] -= 1
        return seconds

    return run


PASSES = 5  # interleaved passes of each configuration
SMOKE_PASSES = 3  # the fewest that give a noise estimate


def passes(given: int | None, smoke: bool) -> int:
    """The number of interleaved passes: ``--passes``, or the default for the size."""
    chosen = given if given is not None else SMOKE_PASSES if smoke else PASSES
    if chosen < 3:
        raise SystemExit(f"--passes {chosen}: at least 3 (fewer give no noise estimate)")
    return chosen


def interleaved(runs: dict[str, Callable[[str], float]], count: int) -> dict[str, list[float]]:
    """Call each run's pass in turn, ``count`` times (fp32, levers, fp32, levers, ...).

    A run is one pass of one configuration: given its label (``"fp32 pass 2/5"``), it enters
    its levers, takes a warm-up step of its own, times its steps and returns the seconds per
    step. Returns each configuration's per-pass times.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(count):
        for name, run in runs.items():
            times[name].append(run(f"{name} pass {index + 1}/{count}"))
    return times


def _geometric_mean(values: list[float]) -> float:
    """The geometric mean: of two paired lists, the ratio of theirs is the geometric mean
    of their ratios, the speedup :func:`paired` gives."""
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _shown(levers: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in levers.items())


def speedup_line(
    name: str,
    times: dict[str, list[float]],
    levers: dict[str, Any],
    device: torch.device,
    smoke: bool = False,
) -> str:
    """The result line: a speedup with its noise, or words where there is nothing to show.

    ``times`` holds the per-pass seconds per step of ``"fp32"`` and ``"speedflags"``; each
    time printed is the geometric mean of its passes, so that the speedup (the geometric
    mean of the per-pass ratios) is the ratio of the two times printed beside it. No
    figure is printed for a run with no levers, or whose levers have no effect on the device
    (both runs did the same work: any difference is noise); a difference within its noise is
    said to be one; an emulated lever (bf16 autocast on a CPU without bf16 instructions) is
    named as such.
    """
    fp32, fast = times["fp32"], times["speedflags"]
    # each time is its passes' geometric mean: their ratio is the paired speedup below
    ms = f"fp32 {_geometric_mean(fp32) * 1e3:.2f} ms/step"
    if not levers:
        recommended = f"speedflags.recommended({str(device)!r})"
        why = f"no lever to apply: {recommended} is empty, none is faster here"
        return f"{name}: {ms}; speedup vs fp32: none shown: {why}"
    fast_ms = f"speedflags ({_shown(levers)}) {_geometric_mean(fast) * 1e3:.2f} ms/step"
    if Config("levers", levers).identical_to_baseline():
        why = "these levers are fp32's own, so both runs did the same work"
        return f"{name}: {ms}; {fast_ms}; speedup vs fp32: none shown: {why}"
    verdicts = verdicts_here(levers, device)
    if nothing_changes(verdicts):
        why = "; ".join(f"{v.label}: {phrase(NO_EFFECT, v.reason)}" for v in verdicts)
        return (
            f"{name}: {ms}; {fast_ms}; speedup vs fp32: none shown: no lever has an effect on "
            f"{device}, so both runs did the same work ({why})"
        )
    found = paired(fast, fp32)
    if found is None:  # fewer than 3 passes: passes() refuses that
        raise ValueError("speedup_line needs three interleaved passes or more")
    speedup, noise = found
    how = f"±{noise * 100:.0f}%, {len(fp32)} interleaved passes"
    emulated = [v.label for v in verdicts if v.status == EMULATED]
    said = f" ({EMULATED} here: {', '.join(emulated)})" if emulated else ""
    smoke_note = " (--smoke: sizes too small to mean anything)" if smoke else ""
    if within_noise(speedup, noise):
        return (
            f"{name}: {ms}; {fast_ms}; speedup vs fp32: none shown: within the noise "
            f"({speedup:.2f}x, {how}){said}{smoke_note}"
        )
    return f"{name}: {ms}; {fast_ms}; speedup vs fp32: {speedup:.2f}x ({how}){said}{smoke_note}"


@contextmanager
def flags_as_found() -> Iterator[None]:
    """Fail (exit 1) if any flag differs at the end from the start."""
    before = speedflags.snapshot()
    yield
    after = speedflags.snapshot()
    if after != before:
        changed = sorted(k for k in before if before[k] != after.get(k))
        print(f"flags changed: {', '.join(changed)}", file=sys.stderr)
        raise SystemExit(1)
    print("flags as found at the start: yes (speedflags.snapshot() unchanged)")
