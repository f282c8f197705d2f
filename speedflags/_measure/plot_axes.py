"""The axes every speedup-against-error plot draws on (``bench --plot``, ``TuneResult.plot``).

matplotlib is an optional extra (``pip install '.[plot]'``), imported only here
and only when a plot is drawn.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._version import install_hint
from .output_paths import make_parent_folder

__all__ = ["MISSING", "PLOT_SUFFIXES", "have_matplotlib", "speedup_axes"]

# What a command line's --plot says without matplotlib (TuneResult.plot has its own words).
MISSING = "--plot needs matplotlib, an optional extra of speedflags: " + install_hint("plot")
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


@contextmanager
def speedup_axes(
    path: str | os.PathLike[str],
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
        >>> from speedflags._measure.plot_axes import speedup_axes
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
