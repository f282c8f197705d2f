"""``@speedup(cuda_graphs=True)``: a step compiled with CUDA graphs, and what happens around them.

A :class:`GraphedStep` holds the step's :class:`~speedflags._compile.guarded.GuardedCompile`,
whose options ask inductor for CUDA graphs (its graph trees record each compiled graph once
and replay it, one launch for its kernels). No capture code of speedflags' own: the rules
applied around each call are :mod:`speedflags._compile.graph_policy`'s, and this module
carries them out and says what happened:

- At the first call the device is resolved (the decorator's ``device=``, else CUDA if
  available). Where CUDA graphs cannot work (a CPU, no CUDA) the option is skipped: the step
  runs as it would without it (compiled if ``compile=`` asked for it, else eagerly), the
  history records why, and ``strict=True`` raises :class:`~speedflags.LeverUnavailableError`
  instead, before the step runs.
- Before each graphed call: the learning rates of the optimizers the step reaches must be
  tensors on their parameters' device (else :class:`~speedflags.CudaGraphsError`, before the
  call runs anything); the arguments' signature must be one recorded, or one of the first
  :data:`~speedflags._compile.graph_policy.SHAPE_LIMIT` (else the call runs eagerly, with one
  :class:`~speedflags.CudaGraphsWarning` per step naming the shapes seen);
  ``torch.compiler.cudagraph_mark_step_begin()`` tells the graph trees a new step begins.
- During it, inductor's "skipping cudagraphs due to ..." messages are read (and let through)
  from its loggers, with its count of skipped graphs where PyTorch keeps one: each new reason
  goes to ``.stats``, the history and one warning.
- After it, each CUDA tensor it returns is copied out of the graph's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .. import _warn
from .._hardware import DeviceLike, missing_cuda, resolve_device
from .._ledger.ledger import ledger
from .._locks import new_lock
from ..errors import (
    CudaGraphsError,
    CudaGraphsWarning,
    DeviceUnavailableWarning,
    LeverUnavailableError,
)
from . import graph_policy as policy
from .guarded import FALLBACK, GuardedCompile, user_where
from .lever_guard import LeverGuard
from .reachable import reachable

__all__ = ["CudaGraphsStats", "GraphedStep", "SkipWatch", "mark_step_begin"]

PENDING, ON, SKIPPED = "pending", "on", "skipped"
_serials = itertools.count(1)
LEVER = "cuda_graphs"  # the name its records carry in the history

# Where inductor says "skipping cudagraphs due to ...": its performance hints (PyTorch 2.1:
# torch/_inductor/compile_fx.py) and, later, its "cudagraphs" artifact logger
# (torch/_inductor/cudagraph_utils.py). Artifact loggers are "<module>.__<artifact>".
SKIP_LOGGERS = tuple(
    f"torch._inductor.{module}.__{artifact}"
    for module in ("compile_fx", "cudagraph_utils", "cudagraph_trees", "output_code", "utils")
    for artifact in ("perf_hints", "cudagraphs")
)
_SKIP = re.compile(r"skipping cudagraphs (?:due to |for )?(.*)", re.IGNORECASE)


def mark_step_begin() -> None:
    """Tell CUDA graph trees that a new step begins (its outputs may be overwritten from now).

    ``torch.compiler.cudagraph_mark_step_begin`` (PyTorch 2.2 and later), else
    ``torch._inductor.cudagraph_mark_step_begin`` (2.1); nothing where neither exists.
    """
    _MARK()


def _find_mark() -> Callable[[], None]:
    found = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if found is None:
        try:
            import torch._inductor as inductor
        except ImportError:  # pragma: no cover - every PyTorch with torch.compile has it
            return lambda: None
        found = getattr(inductor, "cudagraph_mark_step_begin", None)
    return found if found is not None else (lambda: None)


_MARK = _find_mark()


_LOGGERS: list[logging.Logger] = []


def _skip_loggers() -> list[logging.Logger]:
    # the same objects torch's getArtifactLogger returns, whichever asks first
    if not _LOGGERS:
        _LOGGERS.extend(logging.getLogger(name) for name in SKIP_LOGGERS)
    return _LOGGERS


_counters: Any = None


def _skip_count() -> int | None:
    """Inductor's count of graphs it did not record (PyTorch 2.2 and later keep one)."""
    global _counters
    if _counters is None:  # dynamo is loaded by the compiled step, not before
        try:
            from torch._dynamo.utils import counters
        except ImportError:  # pragma: no cover - every PyTorch with torch.compile has it
            return None
        _counters = counters
    return int(_counters["inductor"].get("cudagraph_skips", 0))


class SkipWatch(logging.Filter):
    """Inductor's reasons for not recording a graph, in this thread, while the watch is open.

    Attached as a filter to inductor's loggers (:data:`SKIP_LOGGERS`) for one call: it reads
    each "skipping cudagraphs ..." record and lets every record through unchanged. On exit,
    skips that inductor counted (``counters["inductor"]["cudagraph_skips"]``) without a
    message are added as one reason of their own.

    Example:
        >>> import logging
        >>> from speedflags._compile.graphed import SKIP_LOGGERS, SkipWatch
        >>> hints = logging.getLogger(SKIP_LOGGERS[0])
        >>> with SkipWatch() as watch:
        ...     hints.warning("skipping cudagraphs due to mutated inputs")
        >>> watch.reasons
        ['mutated inputs']
    """

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.reasons: list[str] = []
        self._loggers = _skip_loggers()
        self._counted: int | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread:
            found = _SKIP.search(record.getMessage())
            if found is not None:
                lines = found.group(1).strip().splitlines()
                reason = lines[0].split(". Found from")[0] if lines else ""  # not the trace
                reason = reason.strip().rstrip(".")
                self.reasons.append(reason or "no reason given")
        return True

    def __enter__(self) -> SkipWatch:
        self._counted = _skip_count()
        for logger in self._loggers:
            logger.addFilter(self)  # levels stay as they are: the filter reads, never drops
        return self

    def __exit__(self, *exc: object) -> None:
        for logger in self._loggers:
            logger.removeFilter(self)
        before, after = self._counted, _skip_count()
        if before is not None and after is not None and after - before > len(self.reasons):
            silent = after - before - len(self.reasons)
            self.reasons.append(
                f"{silent} graph(s) inductor counted as skipped without a message (a graph "
                "with no CUDA work, for one)"
            )


@dataclasses.dataclass(frozen=True)
class CudaGraphsStats:
    """What CUDA graphs did for a ``@speedup(cuda_graphs=True)`` step, as of the moment
    ``step.stats.cuda_graphs`` was read (each read makes a new one).

    Attributes:
        state: ``"pending"`` (not called yet), ``"on"`` (graphed), ``"skipped"`` (no effect
            on the device: ``reason`` says why; the step runs as without the option).
        reason: why it was skipped, or None.
        limit: how many distinct input signatures it records graphs for.
        shapes: the signatures graphed, described (``"x: (16, 64, 256)"``), in order.
        recorded: how many signatures graphs were recorded for (``len(shapes)``).
        beyond_limit: how many distinct signatures came after the limit (run eagerly).
        graphed_calls: calls that ran through the compiled step (replays, recordings and
            the graph trees' warm-up runs).
        eager_calls: calls past the limit, run eagerly.
        skips: inductor's reasons for graphs it did not record ("mutated inputs", ...).

    Example:
        >>> import speedflags
        >>> @speedflags.speedup(cuda_graphs=True, device="cpu")
        ... def step():
        ...     pass
        >>> step()
        >>> step.stats.cuda_graphs.state, step.stats.cuda_graphs.reason[:17]
        ('skipped', 'no effect on cpu:')
    """

    state: str
    reason: str | None
    limit: int
    shapes: list[str]
    recorded: int
    beyond_limit: int
    graphed_calls: int
    eager_calls: int
    skips: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The stats as plain values."""
        return dataclasses.asdict(self)


class GraphedStep:
    """One ``@speedup(cuda_graphs=True)`` step: see the module docstring.

    ``compile_options`` are the step's own ``compile=`` options (``None``: not asked for);
    they are checked against CUDA graphs here, when the decorator is built. Calling it calls
    the step. ``graphs`` is ``"pending"``, ``"on"`` or ``"skipped"`` (``graphs_reason``
    says why), ``graph_stats()`` its :class:`CudaGraphsStats` now. ``SpeedupStats`` reads it as
    a :class:`GuardedCompile` (``state``, ``reason``, ``options``, ``levers``: those of the
    compiled step, once there is one).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        compile_options: dict[str, Any] | None,
        label: str,
        device: DeviceLike,
        strict: bool,
        shown: str,
    ) -> None:
        self.func = func
        self.label = label
        self.graphs = PENDING
        self.graphs_reason: str | None = None
        self.compiled: GuardedCompile | None = None
        self.budget = policy.ShapeBudget()
        self.names = policy.argument_names(func)
        self.skips: list[str] = []
        self.graphed_calls = 0
        self.eager_calls = 0
        self._user_options = compile_options
        policy.graph_options(compile_options, shown)  # refused now, not at the first call
        self._device = device
        self._strict = strict
        self._device_type = "cuda"
        self._optimizers: list[torch.optim.Optimizer] = []
        self._was_tensor: dict[Hashable, bool] = {}
        self._lock = new_lock()
        self._warned_limit = False
        self._serial = next(_serials)

    def graph_stats(self) -> CudaGraphsStats:
        """What CUDA graphs did for this step so far."""
        seen = self.budget.seen
        return CudaGraphsStats(
            state=self.graphs,
            reason=self.graphs_reason,
            limit=self.budget.limit,
            shapes=[policy.describe_signatures([s], self.names) for s in seen],
            recorded=len(seen),
            beyond_limit=self.budget.beyond_count,
            graphed_calls=self.graphed_calls,
            eager_calls=self.eager_calls,
            skips=list(self.skips),
        )

    # --- read by SpeedupStats, as a GuardedCompile ---------------------------------------

    @property
    def state(self) -> str:
        """The compile state: ``"pending"``, ``"eager"`` (graphs skipped, no ``compile=``),
        ``"compiled"`` or ``"fallback"``."""
        if self.compiled is not None:
            return self.compiled.state
        return "pending" if self.graphs is PENDING else "eager"

    @property
    def reason(self) -> str | None:
        """Why compiling fell back to eager, or None."""
        return None if self.compiled is None else self.compiled.reason

    @property
    def options(self) -> dict[str, Any] | None:
        """The torch.compile options in use (None before the first call, or without compile)."""
        return None if self.compiled is None else self.compiled.options

    @property
    def levers(self) -> LeverGuard | None:
        return None if self.compiled is None else self.compiled.levers

    # --- a call ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.graphs is PENDING:
            self._start(args, kwargs)
        if self.graphs is SKIPPED:
            target = self.func if self.compiled is None else self.compiled
            return target(*args, **kwargs)
        compiled = self.compiled
        if compiled is None or compiled.state is FALLBACK:  # compiling failed: eager
            return self.func(*args, **kwargs)
        problems = policy.rate_problems(self._optimizers, self._was_tensor)
        if problems:
            raise CudaGraphsError(
                f"{self.label}: cuda_graphs=True: {'; '.join(problems)}. The call did not run."
            )
        key = policy.signature(args, kwargs)
        decision = self.budget.admit(key)
        if decision == "eager":
            self.eager_calls += 1
            if not self._warned_limit:
                self._limit_reached()
            return self.func(*args, **kwargs)
        if decision == "record":
            self._recording(key)
        mark_step_begin()
        with SkipWatch() as watch:
            out = compiled(*args, **kwargs)
        self.graphed_calls += 1
        if watch.reasons:
            self._skipped_graphs(watch.reasons)
        return policy.keep_outputs(out, self._device_type)

    def _start(self, args: Any, kwargs: Any) -> None:
        """At the first call: graphs on, or skipped with the reason (refused if strict)."""
        with self._lock:
            if self.graphs is not PENDING:
                return
            device = resolve_device(self._device, "speedup")
            why = policy.unavailable(device)
            if why is not None and self._strict:
                raise LeverUnavailableError(
                    f"{self.label}: cuda_graphs=True: {why} (strict=True refuses a lever "
                    "without effect here; the step did not run)"
                )
            where = user_where()
            if why is not None:
                self.graphs_reason = why
                if self._user_options is not None:
                    self.compiled = GuardedCompile(self.func, self._user_options, self.label)
                self.graphs = SKIPPED
                ledger().note(LEVER, "skip", why, before=False, after=False, label=self.label,
                              where=where)  # fmt: skip
                if device.type == "cuda" and missing_cuda(device) is not None:
                    message = (
                        f"{self.label}: cuda_graphs=True on {device}: {missing_cuda(device)}, "
                        "so it changes nothing; the step runs without CUDA graphs. strict=True "
                        "refuses it."
                    )
                    _warn.warn_once(("no device", str(device), LEVER), message,
                                    DeviceUnavailableWarning)  # fmt: skip
                return
            kinds = (torch.optim.Optimizer,)
            self._optimizers = reachable(self.func, args, kwargs, kinds, further=True)
            self._device_type = device.type  # the outputs copied out of the graphs' memory
            options = policy.graph_options(self._user_options, self.label)
            self.compiled = GuardedCompile(self.func, options, self.label)
            self.graphs = ON
            ledger().note(
                LEVER,
                "set",
                f"torch.compile with CUDA graphs (inductor's graph trees) on {device}; graphs "
                f"recorded for at most {self.budget.limit} input shapes; optimizers found: "
                f"{len(self._optimizers)}",
                before=False,
                after=True,
                label=self.label,
                where=where,
            )

    def _recording(self, key: policy.Signature) -> None:
        count = len(self.budget.seen)
        shown = policy.describe_signatures([key], self.names)
        ledger().note(
            LEVER,
            "record",
            f"input shapes {count} of {self.budget.limit}: {shown}",
            label=self.label,
            where=user_where(),
        )

    def _limit_reached(self) -> None:
        self._warned_limit = True
        seen = [*self.budget.seen, *self.budget.beyond]
        shapes = policy.describe_signatures(seen, self.names)
        numbers = policy.number_arguments(seen, self.names)
        hint = (
            " Pad inputs to a few fixed lengths (buckets) to keep every call graphed."
            if not numbers
            else f" {', '.join(numbers)}: a Python number that changes between calls is "
            "part of the signature (a graph per value); pass it as a tensor on the device."
        )
        reason = (
            f"{len(seen)} distinct input shapes, past the limit of {self.budget.limit}: "
            f"{shapes}. Calls with the shapes recorded keep replaying their graphs; calls "
            f"with any other shape run eagerly, without recording.{hint}"
        )
        ledger().note(LEVER, "fallback", reason, before="graphs", after="eager (new shapes)",
                      label=self.label, where=user_where())  # fmt: skip
        _warn.warn_once(
            ("cuda-graphs-limit", self._serial), f"{self.label}: {reason}", CudaGraphsWarning
        )

    def _skipped_graphs(self, reasons: list[str]) -> None:
        for reason in reasons:
            if reason in self.skips:
                continue
            self.skips.append(reason)
            text = f"inductor did not record a CUDA graph: {reason}"
            ledger().note(LEVER, "skip", text, before=True, after=False, label=self.label,
                          where=user_where())  # fmt: skip
            _warn.warn_once(
                ("cuda-graphs-skip", self._serial, reason),
                f"{self.label}: {text}; that graph runs compiled, without CUDA graphs.",
                CudaGraphsWarning,
            )
