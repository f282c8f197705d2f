"""The parts of ``make gpu-check``'s summary that read the tests' JUnit files and the
scripts' results: the FP8 headroom (``benchmarks/fp8_headroom.py``), the train step
(``benchmarks/train_step_interleaved.py``) and the frame overhead
(``benchmarks/overhead_interleaved.py``). :mod:`.summary` puts them together.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

__all__ = [
    "fp8_rows",
    "fp8_section",
    "junit_counts",
    "not_run",
    "overhead_section",
    "table",
    "tests_section",
    "train_section",
    "train_step_rows",
]


def table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """A Markdown table's lines (a ``|`` inside a cell escaped).

    Example:
        >>> from tools.gpu_check.sections import table
        >>> print("\\n".join(table(("a", "b"), [("1", "x|y")])))
        | a | b |
        | --- | --- |
        | 1 | x\\|y |
    """
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def not_run(script: str) -> str:
    """The line a section shows in place of a script's results when it did not run or
    left no ``<script>.json``.

    Example:
        >>> from tools.gpu_check.sections import not_run
        >>> not_run("overhead")
        'overhead did not run or left no overhead.json'
    """
    return f"{script} did not run or left no {script}.json"


def junit_counts(path: str) -> dict[str, Any] | None:
    """Outcomes in a JUnit XML file pytest wrote: counts, the failed and errored tests (with
    the first line of each message) and test seconds per file; None when it is unreadable.

    Example:
        >>> import tempfile
        >>> from tools.gpu_check.sections import junit_counts
        >>> xml = ('<testsuites><testsuite><testcase classname="tests.test_a" name="t1" '
        ...        'time="2.5"/><testcase classname="tests.test_a" name="t2" time="1">'
        ...        '<failure message="assert 1 == 2"/></testcase></testsuite></testsuites>')
        >>> with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as fh:
        ...     _ = fh.write(xml)
        >>> found = junit_counts(fh.name)
        >>> found["passed"], found["failed"], found["seconds_by_file"]
        (1, ['tests/test_a.py::t2: assert 1 == 2'], {'tests/test_a.py': 3.5})
    """
    try:
        root = ET.parse(path).getroot()  # noqa: S314 - pytest's own file, written by the check
    except (OSError, ET.ParseError):
        return None
    found: dict[str, Any] = {"passed": 0, "failed": [], "errors": [], "skipped": 0}
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in root.iter("testcase"):
        file = _file_of(str(case.get("classname", "")))
        seconds[file] += float(case.get("time") or 0)
        test = f"{file}::{case.get('name')}"
        outcome = None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child
                break
        if outcome is None:
            found["passed"] += 1
        elif outcome.tag == "skipped":
            found["skipped"] += 1
        else:
            message = (outcome.get("message") or "").strip().splitlines()
            where = "failed" if outcome.tag == "failure" else "errors"
            found[where].append(f"{test}: {message[0][:160]}" if message else test)
    ranked = sorted(seconds.items(), key=lambda item: -item[1])
    found["seconds_by_file"] = {f: round(t, 1) for f, t in ranked}
    return found


def _file_of(classname: str) -> str:
    """The test file of a JUnit class name: ``tests.test_a.TestX`` is ``tests/test_a.py``."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return "/".join(parts) + ".py"


def _junit_files(folder: str) -> list[tuple[str, str]]:
    named = [
        ("suite", "suite.xml"),
        ("gpu-tests", "gpu-tests.xml"),
        ("benchmarks", "benchmarks.xml"),
    ]
    shards = sorted(
        glob.glob(os.path.join(folder, "suite-*.xml")),
        key=lambda p: int(os.path.basename(p)[6:-4]) if os.path.basename(p)[6:-4].isdigit() else 0,
    )
    found = [(run, os.path.join(folder, name)) for run, name in named[:1]]
    found += [(os.path.basename(p)[:-4], p) for p in shards]
    found += [(run, os.path.join(folder, name)) for run, name in named[1:]]
    return [(run, path) for run, path in found if os.path.exists(path)]


def tests_section(folder: str) -> list[str]:
    """The lines on the tests that ran: counts per JUnit file (the suite's, the GPU tests',
    the benchmarks'), every failure and error by name, and the suite's slowest files.

    Example:
        >>> import tempfile
        >>> from tools.gpu_check.sections import tests_section
        >>> tests_section(tempfile.mkdtemp())
        ['no JUnit file: no test step ran']
    """
    rows: list[tuple[str, ...]] = []
    failures: list[str] = []
    seconds: dict[str, float] = collections.defaultdict(float)
    for run, path in _junit_files(folder):
        counts = junit_counts(path)
        if counts is None:
            rows.append((run, "unreadable", "-", "-", "-"))
            continue
        rows.append(
            (
                run,
                str(counts["passed"]),
                str(len(counts["failed"])),
                str(len(counts["errors"])),
                str(counts["skipped"]),
            )
        )
        failures += [f"- {run}, failed: {t}" for t in counts["failed"]]
        failures += [f"- {run}, error: {t}" for t in counts["errors"]]
        if run.startswith("suite"):
            for file, spent in counts["seconds_by_file"].items():
                seconds[file] += spent
    if not rows:
        return ["no JUnit file: no test step ran"]
    lines = table(("run", "passed", "failed", "errors", "skipped"), rows)
    if failures:
        lines += ["", *failures]
    if seconds:
        slowest = ", ".join(
            f"{f.removeprefix('tests/')} {t:.0f} s"
            for f, t in sorted(seconds.items(), key=lambda item: -item[1])[:10]
        )
        lines += ["", f"The suite's slowest files (test seconds): {slowest}."]
    return lines


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def fp8_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """(size, configuration, median, TFLOP/s, of the dense peak, vs bf16, vs fp32, error)
    per row of ``fp8-headroom.json``.

    Example:
        >>> from tools.gpu_check.sections import fp8_rows
        >>> data = {"results": [{"size": 8192, "config": "fp8", "arithmetic": "fp8",
        ...         "median_s": 1e-3, "tflop_per_s": 1099.5, "of_peak": 0.5556,
        ...         "peak_tflop_per_s": 1978.9, "speedup_vs_bf16": 1.6, "speedup_vs_fp32": 21.0,
        ...         "rel_error": 0.031}]}
        >>> fp8_rows(data)[0]
        ('8192', 'fp8', '1.000 ms', '1.1e+03', '56% of 1978.9 fp8', '1.60x', '21.00x', '3.1e-02')
    """
    rows: list[tuple[str, ...]] = []
    for r in data.get("results") or []:
        share = "-"
        if r.get("of_peak") is not None:
            share = f"{_pct(r['of_peak'])} of {r['peak_tflop_per_s']:g} {r['arithmetic']}"
        rows.append(
            (
                str(r.get("size")),
                str(r.get("config")),
                f"{r['median_s'] * 1e3:.3f} ms",
                f"{r['tflop_per_s']:.3g}",
                share,
                *(
                    f"{r[k]:.2f}x" if r.get(k) is not None else "-"
                    for k in ("speedup_vs_bf16", "speedup_vs_fp32")
                ),
                f"{r['rel_error']:.1e}" if not math.isnan(r["rel_error"]) else "NaN",
            )
        )
    return rows


def fp8_section(data: dict[str, Any] | None) -> list[str]:
    """The lines on ``fp8-headroom.json``: a dry run said as such, the table of
    :func:`fp8_rows`, the fp8 rows against the published maximum, what went wrong.

    Example:
        >>> from tools.gpu_check.sections import fp8_section
        >>> data = {"settings": {"dry_run": True}, "no_fp8_gpu": "no CUDA device"}
        >>> fp8_section(data)[0]
        'A dry run on the CPU (no CUDA device): no figure here is a measurement.'
    """
    if data is None:
        return [not_run("fp8-headroom")]
    lines = []
    settings = data.get("settings") or {}
    if settings.get("dry_run"):
        lines += [
            f"A dry run on the CPU ({data.get('no_fp8_gpu') or 'asked for'}): no figure "
            "here is a measurement.",
            "",
        ]
    lines += table(
        (
            "size",
            "configuration",
            "median",
            "TFLOP/s",
            "of dense peak",
            "vs bf16",
            "vs fp32",
            "error vs float64",
        ),
        fp8_rows(data),
    )
    for r in data.get("results") or []:
        if r.get("config") == "fp8" and r.get("of_published_max") is not None:
            lines.append(
                f"\nfp8 at {r['size']}: {_pct(r['of_published_max'])} of the "
                f"published measured maximum ({r['published_max_tflop_per_s']:g})."
            )
    if data.get("fp8_rows_skipped"):
        lines.append(f"\nThe fp8 rows did not run: {data['fp8_rows_skipped']}")
    lines += [f"\nWRONG: {p}" for p in data.get("problems") or []]
    return lines


def train_step_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """(variant, median, quartiles, speedup, loss error, graph launches per step, mode or
    why skipped) per variant of ``train-step.json``.

    Example:
        >>> from tools.gpu_check.sections import train_step_rows
        >>> data = {"variants": [{"variant": "speedup-bf16-graphs", "median_s": 0.002,
        ...         "iqr_s": [0.0019, 0.0021], "speedup_vs_baseline": 2.15,
        ...         "loss_rel_err_vs_baseline": 0.004, "graph_launches_per_step": 3,
        ...         "mode": "compiled"}]}
        >>> train_step_rows(data)[0]
        ('speedup-bf16-graphs', '2.0 ms', '1.9-2.1 ms', '2.15x', '4.0e-03', '3', 'compiled')
    """
    rows: list[tuple[str, ...]] = []
    for v in data.get("variants") or []:
        if v.get("skipped"):
            rows.append((v["variant"], "-", "-", "-", "-", "-", f"skipped: {v['skipped']}"))
            continue
        low, high = v.get("iqr_s") or (math.nan, math.nan)
        rows.append(
            (
                v["variant"],
                f"{v['median_s'] * 1e3:.1f} ms",
                f"{low * 1e3:.1f}-{high * 1e3:.1f} ms",
                f"{v['speedup_vs_baseline']:.2f}x",
                f"{v.get('loss_rel_err_vs_baseline', math.nan):.1e}",
                str(v.get("graph_launches_per_step", "-")),
                str(v.get("mode", "eager")),
            )
        )
    return rows


def train_section(data: dict[str, Any] | None) -> list[str]:
    """The lines on ``train-step.json``: the device, the table of :func:`train_step_rows`,
    what went wrong.

    Example:
        >>> from tools.gpu_check.sections import train_section
        >>> data = {"environment": {"device_name": "NVIDIA H100"},
        ...         "settings": {"rounds": 5, "baseline": "eager-fp32"}}
        >>> train_section(data)[0]
        'NVIDIA H100, round-robin rounds: 5; speedup against eager-fp32.'
    """
    if data is None:
        return [not_run("train-step")]
    settings = data.get("settings") or {}
    lines = [
        f"{data.get('environment', {}).get('device_name', '?')}, "
        f"round-robin rounds: {settings.get('rounds', '?')}; speedup against "
        f"{settings.get('baseline', '?')}.",
        "",
    ]
    lines += table(
        ("variant", "median", "quartiles", "speedup", "loss error", "graph launches/step", "mode"),
        train_step_rows(data),
    )
    lines += [f"\nWRONG: {p}" for p in data.get("problems") or []]
    return lines


def overhead_section(data: dict[str, Any] | None) -> list[str]:
    """The lines on ``overhead.json``: each variant's cost per call against plain torch's,
    and each goal met or not.

    Example:
        >>> from tools.gpu_check.sections import overhead_section
        >>> data = {"per_call": {"fast_math": {"median_s": 1.2e-5, "median_ratio": 1.9,
        ...         "min_s": 1.1e-5, "min_ratio": 1.8}}, "verdicts": ["goal: ... not met"]}
        >>> overhead_section(data)[2:]
        ['| variant | median | of plain torch | min | of plain torch |', \
'| --- | --- | --- | --- | --- |', '| fast_math | 12.00 us | 1.90x | 11.00 us | 1.80x |', \
'', '- goal: ... not met']
    """
    if data is None:
        return [not_run("overhead")]
    env = data.get("environment") or {}
    lines = [f"PyTorch {env.get('torch', '?')}, Python {env.get('python', '?')}; per call:", ""]
    rows = [
        (
            name,
            f"{f['median_s'] * 1e6:.2f} us",
            f"{f['median_ratio']:.2f}x",
            f"{f['min_s'] * 1e6:.2f} us",
            f"{f['min_ratio']:.2f}x",
        )
        for name, f in (data.get("per_call") or {}).items()
    ]
    lines += table(("variant", "median", "of plain torch", "min", "of plain torch"), rows)
    lines += ["", *(f"- {v}" for v in data.get("verdicts") or [])]
    return lines
