"""The benchmark session: speedflags' measurement engine driven by pytest-benchmark, one table.

``pytest benchmarks/ --benchmark-only`` times every lever configuration; after
pytest-benchmark's own table, a second one gives, per group (workload, device and size),
the median per call, the speedup over the group's baseline in this run, FLOP/s, the share of
the fastest configuration and the relative error against float64.

How a benchmark takes part:

- A workload suite (``test_matmul.py`` and friends) sets ``WORKLOAD = "<name>"`` (a key of
  ``speedflags.bench.WORKLOADS``) and has one test taking ``measure, device,
  size, config``; this file parametrizes it and ``measure`` does the rest.
- Any other benchmark sets its ``group`` (``@pytest.mark.benchmark(group=...)``) and names
  its group's baseline in one of two ways: an entry ``group -> variant`` in
  :data:`BASELINES` (the variant is the test's parameter id, or the value of one of its
  parameters: ``"fp32-eager"`` names ``test_train_step[fp32-eager-cpu]``), or
  ``benchmark.extra_info["baseline"] = True`` in the baseline variant. Optional
  ``extra_info`` keys the table reads: ``"config"`` (the row's label; default the parameter
  id), ``"flops"`` (per call), ``"rel_error"``, ``"calls_per_round"`` (when one round
  makes several calls).

Sizes: each workload's defaults for the device (CPU: matmul 1024 and 2048; GPU: 4096 and
8192). With ``--benchmark-disable`` (CI, ``make test``) every benchmark runs once at a
small "smoke" size, so that the suites cannot rot and stay fast. ``--bench-sizes`` overrides
both: ``smoke``, ``default``, or comma-separated sizes.

Timing (see ``speedflags._measure.timing``, re-exported by ``speedflags.bench``):
``benchmark.pedantic`` with the setup and the target each ending in a device
synchronisation (so the host clock brackets the GPU work), a warm-up inside the
configuration's frames before it, rounds sized to last about a second, and input sets
rotated past the last-level cache. On a GPU, kernels under a
millisecond run several times per round (``extra_info["calls_per_round"]``; the table
divides by it), so that the synchronisation does not distort them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags
from speedflags._ledger.history import json_default
from speedflags.bench import (
    TOLERANCE,
    WORKLOADS,
    Problem,
    Result,
    Workload,
    coarsest,
    finish,
    plan_calls,
    plan_rounds,
    render,
    synced,
    timer_for,
    warm_up,
)

# group -> the variant that is the group's baseline (its parameter id, or one parameter value)
BASELINES: dict[str, str] = {
    "enter-exit": "plain-torch",
    "speedup-overhead": "fast_math-decorated",
    "train-step-cpu": "fp32-eager",
    "train-step-cuda": "fp32-eager",
}

DEVICES = ("cpu", "cuda")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-sizes",
        default=None,
        help="speedflags workload sizes: 'smoke', 'default' or comma-separated sizes "
        "(default: 'smoke' with --benchmark-disable, else each workload's sizes per device)",
    )


def _sizes(config: pytest.Config, workload: Workload, device: str) -> tuple[int, ...]:
    option = config.getoption("--bench-sizes")
    if option is None:
        option = "smoke" if config.getoption("benchmark_disable") else "default"
    if option == "smoke":
        return (workload.smoke_size,)
    if option == "default":
        return workload.sizes.get(device, ())
    try:
        return tuple(int(s) for s in option.split(",") if s.strip())
    except ValueError:
        raise pytest.UsageError(
            f"--bench-sizes {option!r}: 'smoke', 'default' or sizes such as 1024,2048"
        ) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    name = getattr(metafunc.module, "WORKLOAD", None)
    if name is None or not {"device", "size", "config"} <= set(metafunc.fixturenames):
        return
    workload = WORKLOADS[name]
    params = [
        pytest.param(
            device,
            size,
            config.name,
            id=f"{device}-{size}-{config.name}",
            marks=[pytest.mark.cuda] if device == "cuda" else [],
        )
        for device in DEVICES
        for size in _sizes(metafunc.config, workload, device)
        for config in workload.configs
    ]
    metafunc.parametrize(("device", "size", "config"), params)


_problem: dict[tuple[str, int, str], Problem] = {}


def _problem_for(workload: Workload, size: int, device: torch.device) -> Problem:
    # One problem alive at a time: its configurations run one after another, and a GPU
    # problem at 8192 holds about a gigabyte.
    key = (workload.name, size, str(device))
    if key not in _problem:
        _problem.clear()
        _problem[key] = workload.build(size, device)
    return _problem[key]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=json_default))


@pytest.fixture
def measure(
    benchmark: Any, request: pytest.FixtureRequest
) -> Callable[[str, int, str], float | None]:
    """Time one configuration of the module's ``WORKLOAD``; return its relative error."""
    workload = WORKLOADS[request.module.WORKLOAD]

    def run(device_name: str, size: int, config_name: str) -> float | None:
        device = torch.device(device_name)
        reason = workload.unavailable(device)
        if reason is not None:
            pytest.skip(reason)
        problem = _problem_for(workload, size, device)
        config = workload.config(config_name)
        reason = (
            workload.idle(config, size)
            or problem.skip_reason(config)
            or workload.same_as_another(config, device)
        )
        if reason is not None:  # idle: fp8's size rule takes no layer at this size
            pytest.skip(reason)
        runner = problem.runner(config)
        problem.reference()
        benchmark.group = f"{workload.name} {device} {size}"
        info = benchmark.extra_info
        info.update(
            workload=workload.name,
            device=str(device),
            size=size,
            shape=problem.shape,
            config=config.name,
            levers=config.describe(),
            baseline=config.baseline,
            flops=problem.flops,
            error_of=problem.error_of,
            input_sets=problem.sets,
            notes=list(config.notes(device)),
        )
        before = speedflags.snapshot()
        with config.frames(device):
            error = problem.error(runner)
            rounds, warmup, calls = 1, 0, 1
            if benchmark.enabled:
                estimate = warm_up(runner, timer_for(device), rounds=2, seconds=0.1)
                calls = plan_calls(estimate, device)
                rounds = plan_rounds(estimate * calls, min_rounds=5, min_time_s=1.0)
                warmup = 1

            def setup() -> tuple[tuple[list[Any]], dict[str, Any]]:
                return ([runner.setup() for _ in range(calls)],), {}

            def target(batch: list[Any]) -> None:
                for inputs in batch:
                    runner.run(*inputs)

            benchmark.pedantic(
                synced(target, device),
                setup=synced(setup, device),
                rounds=rounds,
                warmup_rounds=warmup,
            )
            info["flags"] = _jsonable(speedflags.snapshot())
        info["calls_per_round"] = calls
        assert speedflags.snapshot() == before, "the configuration's frames did not restore"
        tolerance = TOLERANCE[coarsest(config.precision, problem.input_precision)]
        info.update(rel_error=error, tolerance=tolerance)
        if benchmark.stats is not None:
            info["flop_per_s"] = problem.flops * calls / benchmark.stats.stats.median
        assert error <= tolerance, (
            f"{config.name}: relative error {error:.2e} above {tolerance:.0e}: this is not "
            f"measuring what it claims"
        )
        return error

    return run


def _rows(benchmarks: list[Any]) -> list[Result]:
    rows = []
    for bench in benchmarks:
        if not bench.stats:
            continue
        info = bench.extra_info
        group = bench.group or bench.name
        config = str(info.get("config") or bench.param or bench.name)
        per_round = int(info.get("calls_per_round", 1))
        named = BASELINES.get(group)
        values = {str(v) for v in (bench.params or {}).values()}
        rows.append(
            Result(
                group,
                config,
                workload=str(info.get("workload", "")),
                baseline=bool(info.get("baseline")) or named == config or named in values,
                median_s=bench.stats.median / per_round,
                flops=info.get("flops"),
                rel_error=info.get("rel_error"),
                notes=tuple(info.get("notes", ())),
            )
        )
    return rows


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled:
        return
    rows = _rows(session.benchmarks)
    if not rows:
        return
    terminalreporter.write_sep(
        "-", "speedflags: median per call, speedup over each group's baseline in this run"
    )
    for line in render(finish(rows)).splitlines():
        terminalreporter.write_line(line)
