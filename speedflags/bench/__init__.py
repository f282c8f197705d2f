"""Measure what each lever buys, with its accuracy cost beside it: ``speedflags bench``.

The command line's runs and the pytest-benchmark suites in ``benchmarks/`` use this module;
the measuring itself is shared with ``tune`` and ``verify`` and lives in
:mod:`speedflags._measure` (workloads, problems, configurations, timing, rounds, accuracy,
verdicts, output paths), whose names benchmarks need are re-exported here. bench's own:

- :mod:`.runner`: interleaved passes, progress, Ctrl-C (:func:`run`, :class:`Settings`);
- :mod:`.results`, :mod:`.table`, :mod:`.plot`: result files, the table, the comparison and
  the speedup-against-error plot;
- :mod:`.config_file`: ``bench --config``, a lever file or a bench file;
- :mod:`.cli`: ``python -m speedflags bench``.

May import: :mod:`speedflags._measure` and every layer below the tools (``fast_math``,
``status``, the levers' registry, ``hardware``, ``errors``); never ``tune`` or ``verify``.
"""

from .._measure.accuracy import TOLERANCE, coarsest, relative_error
from .._measure.configs import Config
from .._measure.rounds import measure_rounds, warm_up
from .._measure.timing import Timing, plan_calls, plan_rounds, synced, timer_for
from .._measure.workloads import WORKLOADS, Problem, Runner, Workload
from .results import BenchRun, Result
from .runner import Progress, Settings, run
from .table import finish, render

__all__ = [
    "TOLERANCE",
    "WORKLOADS",
    "BenchRun",
    "Config",
    "Problem",
    "Progress",
    "Result",
    "Runner",
    "Settings",
    "Timing",
    "Workload",
    "coarsest",
    "finish",
    "measure_rounds",
    "plan_calls",
    "plan_rounds",
    "relative_error",
    "render",
    "run",
    "synced",
    "timer_for",
    "warm_up",
]
