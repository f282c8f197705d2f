"""What the speedflags.tune test files share: a quick search plan, a virtual clock, a row lookup."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import speedflags
from speedflags._tune.compare import Effort
from speedflags._tune.result import Row

QUICK = Effort(short_s=0.0, short_rounds=5, long_s=0.0, long_rounds=9, warmup_s=0.0)


def ticking() -> Callable[[], float]:
    """A clock that advances one virtual second per read: every call takes exactly 1 s."""
    counter = itertools.count()
    return lambda: float(next(counter))


def row(result: speedflags.TuneResult, **levers: Any) -> Row:
    return next(r for r in result.rows if r.levers == levers and not r.compile)
