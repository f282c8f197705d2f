"""``--plot PATH``: speedup against relative error, one point per configuration (a PNG).

matplotlib is an optional extra (``pip install 'speedflags[plot]'``), imported only here
and only when a plot is asked for.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, Union

from .output_paths import make_parent_folder
from .results import BenchRun, Result, describe_source

__all__ = ["MISSING", "PLOT_SUFFIXES", "have_matplotlib", "plot", "speedup_axes"]

MISSING = "--plot needs matplotlib, an optional extra of speedflags: pip install 'speedflags[plot]'"
# The file types a plot is written as (matplotlib picks the format by the suffix; without
# one it would write "PATH.png" while the command reported PATH).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


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


@contextmanager
def speedup_axes(
    path: Union[str, os.PathLike[str]],
    *,
    missing: str,
    xlabel: str,
    ylabel: str,
    title: str,
    legend: bool = True,
) -> Iterator[Any]:
    """The axes of a speedup-against-error PNG (``bench --plot`` and ``TuneResult.plot``).

    The body draws the points; on leaving, the 1x line, the log error axis, the labels and
    the grid are added and the figure is written to ``path`` (its folder is created if
    missing). The figure is closed either way.

    Raises:
        ImportError: matplotlib is not installed, with the message ``missing``.

    Example:
        >>> from speedflags.bench.plot import speedup_axes
        >>> with speedup_axes("speedup.png", missing="needs matplotlib", xlabel="error",
        ...                   ylabel="speedup (x)", title="demo") as ax:  # doctest: +SKIP
        ...     _ = ax.scatter([1e-3], [1.5], label="bf16")
    """
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(missing) from None
    matplotlib.use("Agg")  # files only; never opens a window
    pyplot: Any = importlib.import_module("matplotlib.pyplot")
    fig, ax = pyplot.subplots(figsize=(8, 5.5), dpi=120)
    try:
        yield ax
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        if legend:
            ax.legend(fontsize=7, loc="best")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        make_parent_folder(path)
        fig.savefig(os.fspath(path))
    finally:
        pyplot.close(fig)


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
            for x, y, row in zip(xs, ys, rows):
                ax.annotate(
                    row.config, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7
                )
            drawn += len(rows)
    return drawn
