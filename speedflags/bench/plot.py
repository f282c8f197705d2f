"""``--plot PATH``: speedup against relative error, one point per configuration (a PNG).

matplotlib is an optional extra (``pip install '.[plot]'``), imported only by
:mod:`speedflags._measure.plot_axes`, and only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._measure.plot_axes import MISSING, speedup_axes
from .results import BenchRun, Result, describe_source

__all__ = ["plot"]


def _points(results: Sequence[Result]) -> dict[str, list[Result]]:
    by_workload: dict[str, list[Result]] = {}
    for row in results:
        if row.skipped or row.speedup is None or row.rel_error is None:
            continue
        by_workload.setdefault(row.group, []).append(row)
    return by_workload


def plot(run: BenchRun, path: str) -> int:
    """Write the speedup-against-error PNG to ``path``; return the number of points drawn.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    groups = _points(run.results)
    drawn = 0
    markers = "osD^vP*X"
    with speedup_axes(
        path,
        missing=MISSING,
        xlabel="relative error against float64 (log scale)",
        ylabel="speedup over the baseline of its group (x)",
        title=f"speedflags bench: {describe_source(run)}",
        legend=bool(groups),
    ) as ax:
        for i, (group, rows) in enumerate(sorted(groups.items())):
            # an exact result (error 0) cannot sit on a log axis: show it at the floor
            xs = [max(r.rel_error or 0.0, 1e-9) for r in rows]
            ys = [r.speedup for r in rows]
            ax.scatter(xs, ys, label=group, marker=markers[i % len(markers)], s=48)
            for x, y, row in zip(xs, ys, rows, strict=True):
                ax.annotate(
                    row.config, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7
                )
            drawn += len(rows)
    return drawn
