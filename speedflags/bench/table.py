"""The result table: speedup over the group's baseline, FLOP/s, share of the fastest, error.

Shared by ``speedflags bench`` and by the pytest session table in ``benchmarks/``, so both
print the same columns computed the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from .._measure.noise import median_error, speedup_and_noise
from .._measure.vocabulary import EMULATED
from .results import BenchRun, Result, describe_source

__all__ = ["finish", "render", "render_compare"]


def finish(results: Iterable[Result]) -> list[Result]:
    """Fill in ``speedup`` (baseline median / median), its ``noise`` (from the interleaved
    passes, :mod:`speedflags._measure.noise`) and ``pct_of_fastest`` per group.

    A group without a measured baseline gets no speedup. Order is kept.

    Example:
        >>> from speedflags.bench.results import Result
        >>> from speedflags.bench.table import finish
        >>> rows = finish([Result("g", "fp32", baseline=True, median_s=0.2),
        ...                Result("g", "amp-bf16", median_s=0.05)])
        >>> [(r.config, r.speedup, r.pct_of_fastest) for r in rows]
        [('fp32', 1.0, 25.0), ('amp-bf16', 4.0, 100.0)]
    """
    rows = list(results)
    baseline: dict[str, Result] = {}
    fastest: dict[str, float] = {}
    for row in rows:
        if row.median_s is None or row.skipped:
            continue
        if row.baseline:
            baseline.setdefault(row.group, row)
        fastest[row.group] = min(fastest.get(row.group, row.median_s), row.median_s)
    out = []
    for row in rows:
        if row.median_s is None or row.skipped:
            out.append(row)
            continue
        base = baseline.get(row.group)
        speedup = noise = None
        if base is not None and base.median_s is not None:
            speedup = base.median_s / row.median_s
            # a row measured once (emulated) has no noise worth a word: it is far apart
            noise = 0.0 if row is base else None if row.verdict else _noise(row, base)
        out.append(
            dataclasses.replace(
                row,
                speedup=speedup,
                noise=noise,
                pct_of_fastest=100.0 * fastest[row.group] / row.median_s,
            )
        )
    return out


def _noise(row: Result, base: Result) -> float | None:
    fast, slow = row.median_s or 0.0, base.median_s or 0.0  # both measured: finish() checks
    _, noise = speedup_and_noise(
        row.pass_medians_s, base.pass_medians_s, fast, slow,
        median_error(fast, row.q1_s, row.q3_s, row.rounds),
        median_error(slow, base.q1_s, base.q3_s, base.rounds),
    )  # fmt: skip
    return noise if math.isfinite(noise) else None  # None: too few rounds to know


def _time(seconds: float | None) -> str:
    return _scaled(seconds, ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")))


def _rate(flop_per_s: float | None) -> str:
    return _scaled(flop_per_s, ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1.0, "")))


def _scaled(value: float | None, units: tuple[tuple[float, str], ...]) -> str:
    # in the first unit (largest first) it reaches, else in the last; "–" for no value
    if value is None:
        return "–"
    scale, unit = next(((s, u) for s, u in units if value >= s), units[-1])
    return f"{value / scale:.4g} {unit}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"  # 0.0081x, not 0.01x


def _speedup(row: Result) -> str:
    # within its noise: no figure in the column, where it would read as a claim (8.76x
    # beside "no difference shown"); the figure and its spread are said below the table
    return "~" if row.within_noise else _ratio(row.speedup)


def _spread(row: Result) -> str:
    passes = len(row.pass_medians_s)
    return f"{_ratio(row.speedup)} ±{(row.noise or 0.0) * 100:.0f}%" + (
        f" over {passes} passes" if passes > 1 else ""
    )


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}%"


def _error(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


def _grid(header: Sequence[str], lines: Sequence[Sequence[str]], left: int) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in lines)]


def render(results: Sequence[Result]) -> str:
    """The table, one line per measured configuration, then the skipped ones with reasons.

    Example:
        >>> from speedflags.bench.results import Result
        >>> from speedflags.bench.table import finish, render
        >>> rows = finish([
        ...     Result("matmul cpu 2048", "fp32", baseline=True, median_s=0.2,
        ...            flops=1.7e10, rel_error=2.5e-7),
        ...     Result("matmul cpu 2048", "amp-bf16", median_s=0.05, flops=1.7e10,
        ...            rel_error=2.9e-3),
        ...     Result("matmul cpu 2048", "tf32", skipped="no effect on cpu")])
        >>> print(render(rows))
        group            config    median  speedup  FLOP/s  % of fastest  rel. error
        ---------------  --------  ------  -------  ------  ------------  ----------
        matmul cpu 2048  fp32      200 ms    1.00x    85 G           25%     2.5e-07
                         amp-bf16   50 ms    4.00x   340 G          100%     2.9e-03
        <BLANKLINE>
        skipped:
          matmul cpu 2048  tf32: no effect on cpu
    """
    header = ["group", "config", "median", "speedup", "FLOP/s", "% of fastest", "rel. error"]
    lines: list[list[str]] = []
    last_group = None
    order: dict[str, int] = {}
    for row in results:
        order.setdefault(row.group, len(order))
    measured = [r for r in results if not r.skipped and r.median_s is not None]
    for row in sorted(measured, key=lambda r: order[r.group]):  # stable: keeps config order
        label = row.config + (" (emulated)" if row.verdict == EMULATED else "")
        label += " *" if row.notes else ""
        lines.append(
            [
                row.group if row.group != last_group else "",
                label,
                _time(row.median_s),
                _speedup(row),
                _rate(row.flop_per_s),
                _pct(row.pct_of_fastest),
                _error(row.rel_error),
            ]
        )
        last_group = row.group
    out = _grid(header, lines, left=2) if lines else ["(nothing measured)"]
    noisy = [r for r in measured if r.within_noise]
    if noisy:
        out.append("")
        out.append(
            "~ within the noise of its interleaved passes: no speedup shown (a gain under 3 %, "
            "or under 2.5 standard errors of the per-pass ratios); the figure and its spread:"
        )
        out.extend(f"  {r.group}  {r.config}: {_spread(r)}" for r in noisy)
    emulated = [r for r in measured if r.verdict == EMULATED]
    if emulated:
        out.append("")
        out.append(
            f"(emulated): {EMULATED}: measured once, at a small size, to show what it costs; "
            "never recommended here"
        )
    noted = [(r.group, r.config, note) for r in results if not r.skipped for note in r.notes]
    if noted:
        out.append("")
        out.append("* levers with no effect on this device (applied and recorded anyway):")
        out.extend(f"  {g}  {c}: {n}" for g, c, n in noted)
    skipped = [r for r in results if r.skipped]
    if skipped:
        out.append("")
        out.append("skipped:")
        out.extend(f"  {r.group}  {r.config}: {r.skipped}" for r in skipped)
    return "\n".join(out)


def _key(row: Result) -> tuple[str, int | None, str]:
    return (row.workload or row.group, row.size, row.config)


def render_compare(a: BenchRun, b: BenchRun, names: tuple[str, str] = ("A", "B")) -> str:
    """Two runs side by side, matched by workload, size and configuration.

    ``B/A`` is A's median over B's: above 1.00x, B is faster.
    """
    na, nb = names
    rows_a = {_key(r): r for r in a.results if not r.skipped and r.median_s is not None}
    rows_b = {_key(r): r for r in b.results if not r.skipped and r.median_s is not None}
    keys = list(rows_a) + [k for k in rows_b if k not in rows_a]
    header = [
        "workload",
        "size",
        "config",
        f"{na} median",
        f"{nb} median",
        f"{nb}/{na}",
        f"{na} speedup",
        f"{nb} speedup",
        f"{na} error",
        f"{nb} error",
    ]
    lines = []
    for key in keys:
        ra, rb = rows_a.get(key), rows_b.get(key)
        ratio = None
        if ra is not None and rb is not None and ra.median_s and rb.median_s:
            ratio = ra.median_s / rb.median_s
        lines.append(
            [
                key[0],
                "" if key[1] is None else str(key[1]),
                key[2],
                _time(ra.median_s if ra else None),
                _time(rb.median_s if rb else None),
                _ratio(ratio),
                _ratio(ra.speedup if ra else None),
                _ratio(rb.speedup if rb else None),
                _error(ra.rel_error if ra else None),
                _error(rb.rel_error if rb else None),
            ]
        )
    out = [f"{na}: {describe_source(a)}", f"{nb}: {describe_source(b)}", ""]
    out += _grid(header, lines, left=3) if lines else ["(no measured results in either file)"]
    out += ["", f"{nb}/{na}: {na}'s median time over {nb}'s (above 1.00x, {nb} is faster)"]
    return "\n".join(out)
