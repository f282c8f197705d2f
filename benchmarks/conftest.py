"""Benchmark session helpers: a ratio table printed after pytest-benchmark's own."""

from __future__ import annotations

from typing import Any, Dict

import pytest

# group name -> baseline benchmark name (the test parameter id)
BASELINES: Dict[str, str] = {
    "enter-exit": "plain-torch",
    "speedup-overhead": "fast_math-decorated",
    "train-step-cpu": "fp32-eager",
    "train-step-cuda": "fp32-eager",
}


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled:
        return
    by_group: Dict[str, Dict[str, float]] = {}
    for bench in session.benchmarks:
        if not bench.stats:
            continue
        variant = bench.param if bench.param else bench.name
        per_round = int(bench.extra_info.get("calls_per_round", 1))
        by_group.setdefault(bench.group or "", {})[str(variant)] = bench.stats.median / per_round
    for group, medians in by_group.items():
        baseline = medians.get(BASELINES.get(group, ""))
        if baseline is None:
            continue
        terminalreporter.write_sep("-", f"{group}: median per call, relative to {BASELINES[group]}")
        for variant, median in sorted(medians.items(), key=lambda kv: kv[1]):
            terminalreporter.write_line(
                f"  {variant:24s} {median * 1e6:9.2f} us   {median / baseline:5.2f}x"
            )
