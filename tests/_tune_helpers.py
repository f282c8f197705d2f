"""What the speedflags.tune test files share: a quick search plan, a virtual clock, a row lookup."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import pytest

import speedflags
from speedflags import hardware
from speedflags.levers import precision
from speedflags.tune.compare import Plan
from speedflags.tune.result import Row

QUICK = Plan(short_s=0.0, short_rounds=5, long_s=0.0, long_rounds=9, warmup_s=0.0)


def ticking() -> Callable[[], float]:
    """A clock that advances one virtual second per read: every call takes exactly 1 s."""
    counter = itertools.count()
    return lambda: float(next(counter))


def row(result: speedflags.TuneResult, **levers: Any) -> Row:
    return next(r for r in result.rows if r.levers == levers and not r.compile)


@pytest.fixture
def bf16_candidates(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """amp='bf16' and matmul_precision='medium' have an effect on this CPU, as on a bf16 CPU.

    tune skips a lever without effect on the device, and the search tests need both tried.
    A CPU without bf16 instructions (or oneDNN bf16 matmuls) cannot show them: only there,
    only those two answers are faked. Autocast and the matmul precision stay PyTorch's real
    flags, and the tests' clock is virtual.
    """
    if not speedflags.capabilities("cpu").cpu_bf16:
        faked = hardware.Capability(True, "bf16 instructions (faked: this CPU has none)")
        monkeypatch.setattr(hardware, "_host_cpu_bf16", lambda: faked)
    if not precision._onednn_bf16():
        monkeypatch.setattr(precision, "_onednn_bf16", lambda: True)
    hardware._clear_cache()
    yield
    hardware._clear_cache()
