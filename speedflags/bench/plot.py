"""``--plot PATH``: speedup against relative error, one point per configuration (a PNG).

matplotlib is an optional extra (``pip install 'speedflags[plot]'``), imported only here
and only when a plot is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Sequence

from .results import BenchRun, Result, describe_source

__all__ = ["MISSING", "have_matplotlib", "plot"]

MISSING = "--plot needs matplotlib, an optional extra of speedflags: pip install 'speedflags[plot]'"


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (checked before a long run, not after)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def _points(results: Sequence[Result]) -> Dict[str, List[Result]]:
    by_workload: Dict[str, List[Result]] = {}
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
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(MISSING) from None
    matplotlib.use("Agg")  # files only; never opens a window
    pyplot: Any = importlib.import_module("matplotlib.pyplot")
    groups = _points(run.results)
    fig, ax = pyplot.subplots(figsize=(8, 5.5), dpi=120)
    drawn = 0
    markers = "osD^vP*X"
    for i, (group, rows) in enumerate(sorted(groups.items())):
        # an exact result (error 0) cannot sit on a log axis: show it at the floor
        xs = [max(r.rel_error or 0.0, 1e-9) for r in rows]
        ys = [r.speedup for r in rows]
        ax.scatter(xs, ys, label=group, marker=markers[i % len(markers)], s=48)
        for x, y, row in zip(xs, ys, rows):
            ax.annotate(row.config, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        drawn += len(rows)
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("relative error against float64 (log scale)")
    ax.set_ylabel("speedup over the baseline of its group (x)")
    ax.set_title(f"speedflags bench: {describe_source(run)}", fontsize=8)
    if groups:
        ax.legend(fontsize=7, loc="best")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    pyplot.close(fig)
    return drawn
