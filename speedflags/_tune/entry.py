"""One candidate of a tuning run as the search and the duel see it, and the step as a runner."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._measure.lever_files import plain_levers
from .._measure.problems import Runner
from .._measure.timing import Timing
from .candidates import Levers
from .result import Row

__all__ = ["Candidate", "StepRunner"]


@dataclass
class Candidate:
    """A candidate: its levers, its wrapped call, its row and its timings.

    ``timing`` is its per-call times from the last timing it took part in, ``against``
    fp32's from the same timing (speedups are paired within one timing).
    """

    levers: Levers
    stage: str
    compile: bool = False
    cuda_graphs: bool = False
    call: Callable[..., Any] | None = None
    row: Row = field(default_factory=lambda: Row({}))
    timing: Timing | None = None
    against: Timing | None = None  # fp32's timing in the same round
    estimate: float | None = None
    rejected: bool = False

    def __post_init__(self) -> None:
        self.row = Row(
            plain_levers(self.levers),
            stage=self.stage,
            compile=self.compile,
            cuda_graphs=self.cuda_graphs,
        )


class HasStep(Protocol):
    """What a runner needs of the search: the step's arguments and its state reset."""

    @property
    def args(self) -> Sequence[Any]: ...

    @property
    def kwargs(self) -> Mapping[str, Any]: ...

    @property
    def state(self) -> Any: ...


class StepRunner(Runner):
    """The user's step as a bench runner: ``setup`` puts the state back (outside the timer)."""

    def __init__(self, call: Callable[..., Any], search: HasStep) -> None:
        super().__init__([()], call)
        self._step = call
        self._search = search

    def setup(self) -> tuple[torch.Tensor, ...]:
        self._search.state.restore()
        return ()

    def run(self, *inputs: torch.Tensor) -> Any:
        return self._step(*self._search.args, **self._search.kwargs)
