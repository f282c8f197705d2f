"""``SpeedupStats``: what a ``@speedup`` step did, read as ``step.stats``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from ._fast_math import FastMath
from ._recommend import recommended
from ._short_repr import set_module

if TYPE_CHECKING:  # compile/ is loaded by a step given compile=, not by import speedflags
    from ._compile.graphed import CudaGraphsStats, GraphedStep
    from ._compile.guarded import GuardedCompile
    from ._compile.lever_guard import LeverGuardStats

__all__ = ["SpeedupStats"]


_STATS_FIELDS = (
    "calls", "mode", "fallback_reason", "compile_options", "inference", "levers", "lever_guard",
    "cuda_graphs",
)  # fmt: skip


@set_module("speedflags")
class SpeedupStats:
    """What a ``@speedup`` function has done: ``step.stats`` (read-only, updated live).

    Attributes:
        calls: how many times the function was called (for generator and coroutine
            functions: how many steps ran); counted without a lock.
        mode: ``"eager"`` (no compile requested), ``"pending"`` (compile requested, not
            called yet), ``"compiled"``, or ``"fallback"`` (compiling failed; runs eagerly).
        compiled: ``mode == "compiled"``.
        fallback_reason: why compiling failed, or ``None``.
        compile_options: the ``torch.compile`` options, or ``None`` without compile.
        inference: whether calls run under ``torch.inference_mode()``.
        levers: the lever values applied around each call (for a bare ``@speedup``, the
            device's recommended levers).
        lever_guard: with compile, how states of the levers dynamo does not guard are kept
            apart (``mode``, ``states``, ``recompiles``: ``docs/compile.md``), else None.
        cuda_graphs: with ``cuda_graphs=True``, what CUDA graphs did (``state``,
            ``reason``, ``shapes`` recorded, ``eager_calls`` past the shape limit, inductor's
            ``skips``: ``docs/cuda_graphs.md``), else None.

    Example:
        >>> import speedflags
        >>> @speedflags.speedup(cudnn_benchmark=True)
        ... def step():
        ...     pass
        >>> step(); step()
        >>> step.stats.calls, step.stats.mode, step.stats.levers
        (2, 'eager', {'cudnn_benchmark': True})
    """

    __slots__ = ("_compile", "_fast", "_inference", "calls")

    def __init__(
        self, fast: FastMath, compiled: GuardedCompile | GraphedStep | None, inference: bool
    ) -> None:
        self.calls = 0
        self._fast = fast
        self._compile = compiled
        self._inference = inference

    @property
    def mode(self) -> str:
        return "eager" if self._compile is None else self._compile.state

    @property
    def compiled(self) -> bool:
        return self.mode == "compiled"  # compile.guarded.COMPILED

    @property
    def fallback_reason(self) -> str | None:
        return None if self._compile is None else self._compile.reason

    @property
    def compile_options(self) -> dict[str, Any] | None:
        options = None if self._compile is None else self._compile.options
        return None if options is None else dict(options)

    @property
    def inference(self) -> bool:
        return self._inference

    @property
    def lever_guard(self) -> LeverGuardStats | None:
        guard = None if self._compile is None else self._compile.levers
        return None if guard is None else guard.stats

    @property
    def cuda_graphs(self) -> CudaGraphsStats | None:
        # a @speedup(cuda_graphs=True) step's GraphedStep has them; a GuardedCompile not
        graph_stats = getattr(self._compile, "graph_stats", None)
        return None if graph_stats is None else cast("CudaGraphsStats", graph_stats())

    @property
    def levers(self) -> dict[str, Any]:
        fast = self._fast
        plan = fast._plan_cache
        if plan is not None:
            program = plan.program
            return {
                lever.name: lever.describe_value(value)
                for lever, value in zip(program.levers, program.values, strict=True)
            }
        if fast._recommend:
            return dict(recommended(fast._device).levers)
        return fast.levers

    def to_dict(self) -> dict[str, Any]:
        """The stats as plain values."""
        values = {name: getattr(self, name) for name in _STATS_FIELDS}
        graphs = self.cuda_graphs
        return {
            **values,
            "lever_guard": self.lever_guard and self.lever_guard.to_dict(),
            "cuda_graphs": graphs and graphs.to_dict(),
        }

    def __repr__(self) -> str:
        reason = f", fallback_reason={self.fallback_reason!r}" if self.fallback_reason else ""
        return (
            f"SpeedupStats(calls={self.calls}, mode={self.mode!r}{reason}, levers={self.levers!r})"
        )
