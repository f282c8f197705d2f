"""The summary ``make gpu-check`` leaves: device, versions, verdicts, speedups, TFLOP/s.

It reads what the check's steps wrote into its output folder (``environment.json``,
``steps.json``, ``verify.json``, ``bench.json``, ``fp8-headroom.json``, ``train-step.json``,
``overhead.json`` and the tests' JUnit files) and writes ``summary.md``. Each lever's row
joins its verdict with the bench configuration that is that lever alone (the speedup at the
workload's largest size); the throughput table puts every measured configuration's TFLOP/s
beside the device's dense datasheet peak for its arithmetic; the tests' table counts each
run's outcomes and names every failure.
"""

from __future__ import annotations

import json
import os
from typing import Any

from speedflags._measure.accuracy import coarsest
from speedflags._measure.workloads import WORKLOADS
from speedflags.errors import SpeedflagsError
from speedflags.levers.registry import lever_spec

from .peaks import peak_for
from .sections import (
    fp8_section,
    not_run,
    overhead_section,
    table,
    tests_section,
    train_section,
)

__all__ = ["lever_rows", "load", "render", "throughput_rows"]


def load(folder: str, name: str) -> dict[str, Any] | None:
    """The JSON object in ``folder/name``, or None when it is missing or unreadable."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same(name: str, a: Any, b: Any) -> bool:
    try:
        spec = lever_spec(name)
        return bool(spec.validate(a) == spec.validate(b))
    except (SpeedflagsError, TypeError, ValueError):
        return False


def _largest(results: list[dict[str, Any]], workload: str, config: str) -> dict[str, Any] | None:
    rows = [
        r
        for r in results
        if r.get("workload") == workload and r.get("config") == config and not r.get("skipped")
    ]
    return max(rows, key=lambda r: r.get("size") or 0) if rows else None


def lever_rows(verified: dict[str, Any], bench: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """(lever, verdict, figure, speedup where measured) per verdict.

    Example:
        >>> from tools.gpu_check.summary import lever_rows
        >>> verified = {"verdicts": [{"lever": "amp", "value": "bf16", "label": "amp='bf16'",
        ...             "status": "verified", "figure": "output bfloat16"}]}
        >>> bench = {"results": [{"workload": "matmul", "config": "amp-bf16", "size": 8192,
        ...          "speedup": 14.2, "group": "matmul cuda:0 8192"}]}
        >>> lever_rows(verified, bench)[0][3]
        'matmul 8192: 14.20x'
    """
    results = (bench or {}).get("results") or []
    rows: list[tuple[str, ...]] = []
    for verdict in verified.get("verdicts") or []:
        lever, value = verdict.get("lever"), verdict.get("value")
        speedups = []
        for workload in WORKLOADS.values():
            for config in workload.configs:
                if list(config.levers) != [lever] or not _same(lever, config.levers[lever], value):
                    continue
                row = _largest(results, workload.name, config.name)
                if row is not None and row.get("speedup") is not None:
                    speedups.append(f"{workload.name} {row.get('size')}: {row['speedup']:.2f}x")
        words = "; ".join(p for p in (verdict.get("figure"), verdict.get("reason")) if p)
        rows.append((verdict.get("label", lever), verdict.get("status", "?"), words,
                     ", ".join(speedups) or "-"))  # fmt: skip
    return rows


def _precision(result: dict[str, Any]) -> str:
    workload = WORKLOADS.get(result.get("workload", ""))
    found = ["fp32"]
    device_type = str(result.get("device", "cpu")).split(":")[0]
    if workload is not None:
        try:
            found.append(workload.config(result.get("config", "")).arithmetic(device_type))
        except KeyError:
            pass
    shape = str(result.get("shape", ""))
    if "bfloat16" in shape:
        found.append("bf16")
    elif "float16" in shape:
        found.append("fp16")
    return coarsest(*found)


def throughput_rows(
    bench: dict[str, Any] | None, device_name: str
) -> list[tuple[str, str, str, str, str]]:
    """(group, configuration, TFLOP/s, arithmetic, share of the dense peak) per measured row.

    Example:
        >>> from tools.gpu_check.summary import throughput_rows
        >>> bench = {"results": [{"workload": "matmul", "config": "amp-bf16", "size": 8192,
        ...          "group": "matmul cuda:0 8192", "flop_per_s": 7.9e14}]}
        >>> throughput_rows(bench, "NVIDIA H100 80GB HBM3")[0]
        ('matmul cuda:0 8192', 'amp-bf16', '790', 'bf16', '80% of 989.4')
    """
    peak = peak_for(device_name)
    rows = []
    for result in (bench or {}).get("results") or []:
        rate = result.get("flop_per_s")
        if result.get("skipped") or not rate:
            continue
        precision = _precision(result)
        share = "-"
        if peak is not None and precision in peak[1]:
            top = peak[1][precision]
            share = f"{100 * rate / 1e12 / top:.0f}% of {top:g}"
        rows.append((result.get("group", "?"), result.get("config", "?"), f"{rate / 1e12:.3g}",
                     precision, share))  # fmt: skip
    return rows


def render(folder: str) -> str:
    """The summary of a ``make gpu-check`` output folder, as Markdown."""
    env = load(folder, "environment.json") or {}
    steps = (load(folder, "steps.json") or {}).get("steps") or []
    verified = load(folder, "verify.json")
    bench = load(folder, "bench.json")
    device = str(env.get("device_name") or "no CUDA device")
    lines = [f"# speedflags gpu-check: {device}", ""]
    for key in ("date", "device", "driver", "cuda", "cudnn", "torch", "python", "gpu_found"):
        lines.append(f"- {key}: {env.get(key, '-')}")
    cpu = env.get("host_cpu") or {}
    if cpu:
        lines.append(
            f"- host CPU: {cpu.get('model')}, {cpu.get('logical_cores')} logical cores, "
            f"{cpu.get('isa')}; bf16: {cpu.get('bf16')}; fp16: {cpu.get('fp16')}; "
            f"AMX: {'yes' if cpu.get('amx') else 'no'}"
        )
    if env.get("gpu_state_start"):
        lines.append(
            f"- GPU at the start (SM clock, its most, power, limit, temperature): "
            f"{env['gpu_state_start']}"
        )
    for step in steps:
        if step.get("gpu_state_after"):
            lines.append(f"- GPU after {step['name']}: {step['gpu_state_after']}")
    peak = peak_for(device)
    lines.append(f"- dense peaks (TFLOP/s): {peak[1] if peak else 'not in the table'}")
    lines += ["", "## Steps", ""]
    lines += table(
        ("step", "status", "seconds", "log"),
        [(s["name"], s["status"], f"{s.get('seconds', 0):.0f}", s.get("log", "")) for s in steps],
    )
    lines += ["", "## Tests", "", *tests_section(folder)]
    lines += ["", "## Levers: verdict and speedup", ""]
    if verified is None:
        lines.append(not_run("verify"))
    else:
        lines += table(
            ("lever", "verdict", "measured", "bench speedup"), lever_rows(verified, bench)
        )
    lines += ["", "## Throughput against the dense peak", ""]
    rows = throughput_rows(bench, device)
    if rows:
        lines += table(("group", "configuration", "TFLOP/s", "arithmetic", "of peak"), rows)
    else:
        lines.append("bench did not run or measured nothing")
    lines += ["", "## FP8 headroom: float8 e4m3 scaled matmul, tensor-wise scales", ""]
    lines += fp8_section(load(folder, "fp8-headroom.json"))
    lines += ["", "## Small transformer train step", ""]
    lines += train_section(load(folder, "train-step.json"))
    lines += ["", "## Frame overhead on this machine's CPU", ""]
    lines += overhead_section(load(folder, "overhead.json"))
    return "\n".join(lines) + "\n"
