"""The measurement loop behind ``speedflags bench``: interleaved passes, progress, Ctrl-C.

For each workload and size, every configuration is measured in several passes, and the
passes are interleaved (A B C, A B C, ...) so that a noisy neighbour or a clock change hits
all configurations alike. The first pass of a configuration measures its error against the
float64 reference, warms up (at least ``warmup_rounds`` calls and ``warmup_s`` seconds) and
sizes its rounds from the warm-up; later passes warm up with one call. The median is taken
over all timed rounds of all passes.

A configuration whose first call raises (a dtype the installed PyTorch has no kernel for,
which the capabilities did not foresee) is skipped with PyTorch's message; a later call that
raises ends the run. A configuration identical to the baseline is not timed against it (the
row says so). An emulated configuration (bf16 or fp16 autocast, or such inputs, on a CPU
without the instructions: tens of times slower) is measured once, beside the baseline, in a
group of its own at a small size (:data:`EMULATED_SIZE` at most), marked "(emulated)", so that
the table shows what it costs and why nothing recommends it; its rows in the other groups say
where it was measured.

Ctrl-C (``KeyboardInterrupt``) stops the run between or inside measurements: the frames
being measured restore every flag as the exception leaves them, and the run returns what
was measured so far, marked ``interrupted``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .._measure.configs import Config
from .._measure.rounds import measure_rounds, warm_up
from .._measure.timing import Timing, plan_calls, plan_rounds, synchronize, timer_for
from .._measure.verdicts import recorded
from .._measure.vocabulary import EMULATED, phrase
from .._measure.workloads import WORKLOADS, Problem, Runner, Workload
from .._status import snapshot
from .._warn import measuring
from . import estimate
from .estimate import ONCE_ROUNDS
from .results import BenchRun, Result, environment, gpu_state
from .table import finish

__all__ = ["EMULATED_SIZE", "ONCE_ROUNDS", "Progress", "Settings", "run"]

EMULATED_SIZE = 256  # an emulated configuration is measured once, at this size at most


@dataclass(frozen=True)
class Settings:
    """What one run measures, and how hard.

    Attributes:
        device: the device to measure on.
        workloads: names from :data:`~speedflags._measure.workloads.WORKLOADS`.
        sizes: sizes for every workload, or None for each workload's defaults on the device.
        passes: interleaved passes over the configurations.
        min_rounds: timed rounds per configuration and pass, at least.
        min_time_s: timed seconds per configuration and pass, at least (up to 1000 rounds).
        warmup_rounds, warmup_s: the first pass's warm-up, in calls and seconds (both met).
        verify: record, before measuring, whether each lever the run uses takes effect on
            the device (``speedflags.verify``; the result's ``environment["verdicts"]``).
        configs: the configurations to compare on every workload instead of each
            workload's own (``bench --config``); one of them is the ``baseline``.
        workload_sizes: sizes per workload, before ``sizes`` and the defaults.
    """

    device: torch.device
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    sizes: tuple[int, ...] | None = None
    passes: int = 3
    min_rounds: int = 5
    min_time_s: float = 0.25
    warmup_rounds: int = 2
    warmup_s: float = 0.1
    verify: bool = True
    configs: tuple[Config, ...] | None = None
    workload_sizes: Mapping[str, tuple[int, ...]] | None = None

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["device"] = str(self.device)
        if self.configs is not None:
            out["configs"] = {c.name: c.describe() for c in self.configs}
        return out

    def configs_of(self, workload: Workload) -> tuple[Config, ...]:
        """The configurations compared on ``workload``."""
        return self.configs if self.configs is not None else workload.configs

    def estimated_s(self, calibration: estimate.Calibration) -> float:
        """How long a run of these settings should take, in seconds, each call taking what
        ``calibration`` says (:mod:`speedflags.bench.estimate`)."""
        plan = self.plan()
        return estimate.seconds(
            plan,
            {workload.name: self.configs_of(workload) for workload, _ in plan},
            self.device,
            calibration,
            passes=self.passes,
            min_rounds=self.min_rounds,
            min_time_s=self.min_time_s,
            warmup_rounds=self.warmup_rounds,
            warmup_s=self.warmup_s,
            emulated_size=EMULATED_SIZE,
            verify=self.verify,
        )

    def plan(self) -> list[tuple[Workload, int | None]]:
        """(workload, size) pairs in run order; size None for a workload the device lacks."""
        pairs: list[tuple[Workload, int | None]] = []
        for name in self.workloads:
            workload = WORKLOADS[name]
            if workload.unavailable(self.device):
                pairs.append((workload, None))
                continue
            given = (self.workload_sizes or {}).get(name)
            sizes = given or self.sizes or workload.sizes.get(self.device.type, ())
            pairs.extend((workload, size) for size in sizes)
        return pairs


@dataclass(frozen=True)
class Progress:
    """One step of a run, for a progress display: ``message`` says it in words.

    ``kind`` is ``"group"`` (a workload and size begins), ``"skip"`` (a configuration is
    skipped), ``"start"`` or ``"done"`` (one configuration's pass; ``median_s`` when done).
    ``step`` counts from 1 towards ``steps`` (one step per configuration and pass; skipped
    configurations shrink ``steps`` when they are found).
    """

    kind: str
    step: int
    steps: int
    group: str
    config: str
    message: str
    median_s: float | None = None


@dataclass
class _Entry:
    config: Config
    runner: Runner | None = None
    rounds: int = 0
    calls: int = 1
    error: float | None = None
    passes: list[list[float]] = field(default_factory=list)
    peak_bytes: int | None = None
    verdict: str = ""


def _group_name(workload: Workload, device: torch.device, size: int | None) -> str:
    return f"{workload.name} {device}" + (f" {size}" if size is not None else "")


def _emulated_size(settings: Settings, workload: Workload) -> int:
    sizes = [size for w, size in settings.plan() if w is workload and size is not None]
    return min([EMULATED_SIZE, *sizes])


class _Run:
    def __init__(self, settings: Settings, progress: Callable[[Progress], None]) -> None:
        self.settings = settings
        self.progress = progress
        self.clock = timer_for(settings.device)
        self.results: list[Result] = []
        self.plan = settings.plan()
        self.step = 0
        self.steps = sum(len(settings.configs_of(w)) for w, _ in self.plan) * settings.passes
        # workload name -> (workload, the emulated configurations to measure once)
        self.emulated: dict[str, tuple[Workload, list[Config]]] = {}

    def tell(
        self, kind: str, group: str, config: str, message: str, median: float | None = None
    ) -> None:
        self.progress(Progress(kind, self.step, self.steps, group, config, message, median))

    def skip(self, row: Result, configs: int = 1, passes: int | None = None) -> Result:
        self.steps -= (self.settings.passes if passes is None else passes) * configs
        self.tell(
            "skip", row.group, row.config, f"{row.group}: skipped {row.config}: {row.skipped}"
        )
        return row

    def group(self, workload: Workload, size: int | None, emulated: Sequence[Config] = ()) -> None:
        """Measure ``workload`` at ``size``; with ``emulated``, the group that measures those
        configurations once, beside the baseline."""
        device = self.settings.device
        name = _group_name(workload, device, size) + (" (emulated)" if emulated else "")
        reason = workload.unavailable(device)
        if reason is None and size is not None:
            reason = workload.too_big(size, device)
        if reason is not None or size is None:
            row = Result(name, "(all)", workload=workload.name, size=size,
                         skipped=reason or "no sizes")  # fmt: skip
            self.results.append(self.skip(row, len(self.settings.configs_of(workload))))
            return
        self.tell("group", name, "", f"{name}: preparing inputs and the float64 reference")
        problem = workload.build(size, device)
        problem.reference()
        rows: list[Result | _Entry] = []
        configs = self.settings.configs_of(workload)
        if emulated:
            configs = tuple(c for c in configs if c.baseline) + tuple(emulated)
        for config in configs:
            idle = workload.idle(config, size)  # it would change nothing here: no timing
            why = idle or problem.skip_reason(config)
            if config.identical_to_baseline():
                why = "identical to the baseline: nothing to compare it with"
            elif idle is None and (why is None or config.emulated(device)):
                same = workload.same_as_another(config, device, configs)
                if same is not None:  # no claim of its own: its levers' words say why
                    why = same
                elif why is not None and emulated:
                    rows.append(_Entry(config, verdict=EMULATED))
                    continue
                elif why is not None:
                    once = _emulated_size(self.settings, workload)
                    there = workload.idle(config, once)
                    if there is None:
                        where = f"measured once, at size {once} (the group below)"
                        later = self.emulated.setdefault(workload.name, (workload, []))[1]
                        if config not in later:  # once per workload, whatever its sizes
                            later.append(config)
                    else:  # where emulated ones are measured, it would change nothing
                        where = f"not measured: at size {once}, where emulated ones are, {there}"
                    why = phrase(EMULATED, f"{why}; {where}")
            if why is None:
                rows.append(_Entry(config))
                continue
            row = Result(name, config.name, workload.name, str(device), size, skipped=why)
            passes = 1 if emulated else self.settings.passes
            rows.append(self.skip(row, passes=passes))
        try:
            for index in range(1 if emulated else self.settings.passes):
                for entry in [e for e in rows if isinstance(e, _Entry)]:
                    try:
                        self.measure(name, problem, entry, index, once=bool(emulated))
                    except (RuntimeError, NotImplementedError) as exc:
                        if entry.passes:  # it ran before: a failure, not a refusal
                            raise
                        at = next(i for i, row in enumerate(rows) if row is entry)
                        rows[at] = self.refused(name, problem, entry.config, exc)
        finally:  # Ctrl-C included: keep what was measured
            self.results.extend(
                e if isinstance(e, Result) else self.result(name, problem, e)
                for e in rows
                if isinstance(e, Result) or e.passes
            )

    def refused(self, name: str, problem: Problem, config: Config, exc: BaseException) -> Result:
        """The row of a configuration whose first call raised: PyTorch refuses it here (a
        dtype it has no kernel for that the capabilities did not foresee)."""
        self.step -= 1  # its first pass was counted as started
        text = str(exc).strip()
        first = text.splitlines()[0][:200] if text else ""
        why = f"PyTorch {torch.__version__} refused it here: {type(exc).__name__}: {first}"
        return self.skip(Result(name, config.name, problem.workload, str(problem.device),
                                problem.size, skipped=why))  # fmt: skip

    def measure(
        self, name: str, problem: Problem, entry: _Entry, index: int, once: bool = False
    ) -> None:
        settings, device = self.settings, self.settings.device
        self.step += 1
        passes = 1 if once else settings.passes
        label = f"{name} {entry.config.name}, pass {index + 1}/{passes}"
        self.tell("start", name, entry.config.name, label)
        held = None
        if entry.runner is None:
            held = _reset_peak(device)  # the configuration's own memory from here on
            entry.runner = problem.runner(entry.config)
        runner = entry.runner
        with entry.config.frames(device, runner.model):
            if once:  # an emulated configuration's group: one warm-up call, a few rounds
                entry.error = problem.error(runner)
                synchronize(device)
                estimate = warm_up(runner, self.clock, 1, 0.0)
                entry.calls = plan_calls(estimate, device)
                entry.rounds = max(1, min(settings.min_rounds, ONCE_ROUNDS))
            elif index == 0:
                entry.error = problem.error(runner)
                synchronize(device)
                estimate = warm_up(runner, self.clock, settings.warmup_rounds, settings.warmup_s)
                entry.calls = plan_calls(estimate, device)
                entry.rounds = plan_rounds(
                    estimate * entry.calls, settings.min_rounds, settings.min_time_s
                )
            else:
                warm_up(runner, self.clock, 1, 0.0)
            entry.passes.append(measure_rounds(runner, self.clock, entry.rounds, entry.calls))
            if held is not None:
                entry.peak_bytes = torch.cuda.max_memory_allocated(device) - held
        median = statistics.median(entry.passes[-1])
        self.tell("done", name, entry.config.name, f"{label}: {_ms(median)}", median)

    def result(self, name: str, problem: Problem, entry: _Entry) -> Result:
        timing = Timing.of(entry.passes)
        quartiles = timing.quartiles
        return Result(
            group=name,
            config=entry.config.name,
            workload=problem.workload,
            device=str(problem.device),
            size=problem.size,
            shape=problem.shape,
            levers=entry.config.describe(),
            baseline=entry.config.baseline,
            median_s=timing.median,
            q1_s=quartiles[0] if quartiles else None,
            q3_s=quartiles[1] if quartiles else None,
            rounds=timing.rounds,
            calls_per_round=entry.calls,
            pass_medians_s=tuple(timing.pass_medians),
            flops=problem.flops,
            rel_error=entry.error,
            error_of=problem.error_of,
            input_sets=problem.sets,
            notes=entry.config.notes(problem.device),
            peak_bytes=entry.peak_bytes,
            verdict=entry.verdict,
        )


def _reset_peak(device: torch.device) -> int | None:
    """On CUDA: start counting the peak of allocated memory; the bytes allocated now (the
    peak a configuration adds is measured from them). None elsewhere: a CPU has no such
    counter."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} us"


def verdicts(settings: Settings) -> dict[str, str]:
    """Whether each lever value the run's configurations use takes effect on the device.

    ``{"amp='bf16'": "verified: output bfloat16, error 2.9e-03 (bf16)", ...}`` from
    :func:`speedflags.verify` (never raises: a failed verification says why).
    """
    levers: dict[str, list[object]] = {}
    for workload, size in settings.plan():
        if size is None:
            continue
        for config in settings.configs_of(workload):
            for name, value in config.levers.items():
                values = levers.setdefault(name, [])
                if value not in values:
                    values.append(value)
    return recorded(settings.device, levers) if levers else {}


def run(
    settings: Settings,
    progress: Callable[[Progress], None] | None = None,
) -> BenchRun:
    """Measure every configuration of the chosen workloads; stop cleanly on Ctrl-C.

    Scope: each measurement opens ``fast_math`` frames (process-wide levers, the calling
    thread's autocast) and restores them on exit; the run records whether every flag reads
    as before once it ends (``flags_restored``). Autocast is the calling thread's.

    Example:
        >>> import torch
        >>> from speedflags.bench.runner import Settings, run
        >>> result = run(Settings(torch.device("cpu"), ("matmul",), sizes=(32,), passes=1,
        ...                       min_rounds=1, min_time_s=0, warmup_rounds=1, warmup_s=0))
        >>> rows = {r.config: r for r in result.results}
        >>> rows["fp32"].speedup, rows["tf32"].skipped, result.flags_restored
        (1.0, 'no effect on cpu: TF32 is a tensor-core mode of ... GPUs; a CPU has none', True)
        >>> result.environment["verdicts"]["tf32=True"][:14]
        'no effect here'
    """
    env = environment(settings.device)
    if settings.verify:
        env["verdicts"] = verdicts(settings)
    before = snapshot()
    state = _Run(settings, progress or (lambda event: None))
    interrupted = False
    started = time.perf_counter()
    try:
        with measuring():  # emulated rows are measured on purpose: the table marks them
            for workload, size in state.plan:
                state.group(workload, size)
            for workload, configs in state.emulated.values():
                state.steps += 1 + len(configs)  # the baseline and each, once
                state.group(workload, _emulated_size(settings, workload), configs)
    except KeyboardInterrupt:
        interrupted = True
    env["elapsed_s"] = round(time.perf_counter() - started, 3)
    env["gpu_state_end"] = gpu_state(settings.device)  # clocks and power after the load
    return BenchRun(
        environment=env,
        settings=settings.to_dict(),
        results=finish(state.results),
        interrupted=interrupted,
        flags_restored=snapshot() == before,
    )
