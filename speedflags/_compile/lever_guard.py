"""Keeping a graph traced under one state of the levers dynamo does not guard from serving another.

Dynamo caches compiled frames per code object and reuses one whenever its guards pass; the
SDPA kernels and order, cuDNN's flags, oneDNN's fp32 precision and fp16 accumulation are not in
those guards (:mod:`speedflags._compile.lever_state` reads them instead), and inductor's
on-disk caches (the FX graph and AOT autograd caches) do not key on them either. So a function
compiled with the flash SDPA kernel enabled runs the flash kernel again once only math is
enabled. A :class:`LeverGuard` reads the state before every call and keeps graphs apart in one
of two ways, chosen by what the running PyTorch offers (never by its version number):

- ``"per_state"``: one compiled artefact per state. From PyTorch 2.2 dynamo matches every
  cached frame to the backend object that compiled it (``torch._dynamo.eval_frame`` keeps
  ``cached_backends``): each state compiles through a backend of its own
  (:class:`LeverBackend`, unequal across states), so every frame the call runs (the function's,
  the resume functions after a graph break, a callee compiled as a frame of its own) has its
  entries per state, and going back to a state reuses them.
- ``"recompile"``: on PyTorch 2.1, which has no such matching, a change of the state seen by
  a guarded call clears dynamo's cache of every frame it has compiled in the process
  (``reset_code``, as ``torch._dynamo.reset()`` does for each), so the next call compiles again
  under the state in force. The first guarded call of the process clears what was compiled
  before it (under a state nobody recorded). Also used where PyTorch would warn "changing
  options to torch.compile()" on every switch of backend.

Either way, while a backend compiles, the state is added to ``torch.compiler.config
.cache_key_tag`` where PyTorch has it (the key of the FX graph and AOT autograd caches), or the
AOT autograd cache is turned off for that compile where PyTorch has the cache but no tag.

Recompiles stay bounded: ``"per_state"`` adds one cache entry per state to each frame, counted
against dynamo's ``recompile_limit`` (``cache_size_limit`` before 2.6; 8 by default). Beyond
it dynamo runs the frame eagerly, with the levers in force (eager's numbers, no speed-up), and
warns; with ``fullgraph=True`` it raises instead. ``"recompile"`` never counts a lever change
against the limit: the cache is empty again after each.

Example:
    >>> from speedflags._compile.lever_guard import guard_mode
    >>> guard_mode() in ("per_state", "recompile")
    True
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._locks import new_lock
from . import backend as _backend
from .lever_state import LeverState, lever_state

__all__ = ["PER_STATE", "RECOMPILE", "LeverBackend", "LeverGuard", "LeverGuardStats", "guard_mode"]

PER_STATE, RECOMPILE = "per_state", "recompile"
Compiled = Callable[..., Any]


def guard_mode() -> str:
    """``"per_state"`` where dynamo keeps cached frames per backend, else ``"recompile"``."""
    import torch._dynamo.eval_frame as eval_frame

    if not hasattr(eval_frame, "cached_backends"):
        return RECOMPILE  # PyTorch 2.1: one cache per frame, whatever the backend
    context = getattr(eval_frame, "OptimizeContext", None)
    if hasattr(context, "_different_backend"):  # pragma: no cover - no such PyTorch tested
        return RECOMPILE  # it would warn "changing options to torch.compile()" per switch
    return PER_STATE


def state_tag(state: LeverState) -> str:
    """A short, stable name for a lever state: the same in every process."""
    digest = hashlib.sha256(repr(state).encode("utf-8", "backslashreplace")).hexdigest()
    return f"speedflags-levers-{digest[:16]}"


def _cache_key_with_state() -> AbstractContextManager[Any]:
    """For one compile: inductor's caches key on the lever state in force, or are bypassed."""
    config = getattr(torch.compiler, "config", None)
    if config is not None and hasattr(config, "cache_key_tag"):
        prior = config.cache_key_tag
        tag = state_tag(lever_state())
        return config.patch(cache_key_tag=f"{prior}|{tag}" if prior else tag)  # type: ignore[no-any-return]
    functorch = getattr(getattr(torch, "_functorch", None), "config", None)
    if functorch is not None and hasattr(functorch, "enable_autograd_cache"):  # pragma: no cover
        return functorch.patch(enable_autograd_cache=False)  # type: ignore[no-any-return]
    return contextlib.nullcontext()  # PyTorch 2.1: no on-disk graph caches


class LeverBackend:
    """The backend one lever state compiles with: ``inner``, with the state in the cache keys.

    ``key`` makes backends of different states unequal (so dynamo keeps their frames apart);
    ``None`` in ``"recompile"`` mode, where one backend serves every state in turn.
    """

    def __init__(self, inner: Callable[..., Any], key: LeverState | None) -> None:
        self._inner = inner
        self.key = key
        self.compiler_name = getattr(inner, "compiler_name", "backend")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # the backward graph compiles now, with the same key (not lazily, in backward())
        with _cache_key_with_state(), _backend.early_backward_lowering():
            return self._inner(gm, example_inputs)

    def __deepcopy__(self, memo: dict[int, Any]) -> LeverBackend:
        return self  # as GuardedBackend's: one backend per compiled function, never copied

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LeverBackend):
            return NotImplemented
        return self.key == other.key and bool(self._inner == other._inner)

    __hash__ = None  # type: ignore[assignment]  # equal by value, as torch's own wrappers

    def reset(self) -> None:
        reset = getattr(self._inner, "reset", None)
        if reset is not None:
            reset()


class _ProcessCaches:
    """``"recompile"`` mode: the lever state every frame dynamo cached was compiled under.

    A graph compiled while no guarded call ran (a plain ``torch.compile``, in this thread or
    another) was compiled under a state nobody recorded: dynamo's count of graphs tells.
    """

    def __init__(self) -> None:
        self.lock = new_lock()
        self.state: LeverState | None = None
        self.graphs = -1  # dynamo's graph count when the last guarded call ended
        self.generation = 0  # how many times the cached frames were forgotten

    def enter(self, state: LeverState) -> int:
        """Forget every compiled frame unless all were compiled under ``state``; the
        generation of the frames cached from now on."""
        graphs = _graph_count()
        if self.generation and state == self.state and graphs == self.graphs:
            return self.generation
        with self.lock:
            if not (self.generation and state == self.state and graphs == self.graphs):
                _forget_compiled_frames()
                self.state = state
                self.generation += 1
            self.graphs = graphs
            return self.generation

    def leave(self) -> None:
        """After a guarded call: what it compiled was compiled under the recorded state."""
        self.graphs = _graph_count()


_counters: Any = None


def _graph_count() -> int:
    global _counters
    if _counters is None:  # dynamo is imported once something compiles, not before
        from torch._dynamo.utils import counters

        _counters = counters
    return int(_counters["stats"]["unique_graphs"])


def _forget_compiled_frames() -> None:
    import torch._dynamo.eval_frame as eval_frame
    from torch._dynamo import convert_frame

    reset_code = eval_frame.reset_code  # type: ignore[attr-defined]  # re-exported from C
    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is not None:
            reset_code(code)


_PROCESS = _ProcessCaches()


class LeverGuardStats:
    """How a compiled model keeps states of the levers dynamo does not guard apart (live).

    ``speedflags.guard_levers(...)``'s ``.stats`` (``.forward.stats`` for a module), and
    ``step.stats.lever_guard`` of a ``@speedup(compile=...)`` step.

    Attributes:
        mode: ``"per_state"`` (one compiled artefact per state, PyTorch 2.2+) or
            ``"recompile"`` (compiled again after each change of the state, PyTorch 2.1).
        states: how many states of those levers compiled calls have run under.
        recompiles: how many times a change of the state made it compile again (in
            ``"per_state"`` mode: each new state after the first).
        calls: the calls that ran compiled code (counted without a lock).

    Example:
        >>> import torch, speedflags
        >>> relu = speedflags.guard_levers(torch.nn.functional.relu, backend="eager")
        >>> relu(torch.tensor([-1.0, 2.0])).tolist()
        [0.0, 2.0]
        >>> relu.stats.calls, relu.stats.states, relu.stats.recompiles
        (1, 1, 0)
    """

    __slots__ = ("_guard",)

    def __init__(self, guard: LeverGuard) -> None:
        self._guard = guard

    @property
    def mode(self) -> str:
        return self._guard.mode

    @property
    def states(self) -> int:
        return len(self._guard.seen)

    @property
    def recompiles(self) -> int:
        return self._guard.recompiles

    @property
    def calls(self) -> int:
        return self._guard.calls

    def to_dict(self) -> dict[str, Any]:
        """The stats as plain values."""
        return {name: getattr(self, name) for name in ("mode", "states", "recompiles", "calls")}

    def __repr__(self) -> str:
        return (
            f"LeverGuardStats(mode={self.mode!r}, states={self.states}, "
            f"recompiles={self.recompiles}, calls={self.calls})"
        )


class LeverGuard:
    """Per call, the compiled callable for the lever state in force (see the module docstring).

    ``make(key)`` compiles the function with a :class:`LeverBackend` of that ``key`` (``None``
    in ``"recompile"`` mode) and returns the callable, or ``None`` if it cannot (the caller
    then runs eagerly). :attr:`stats` is what it has done.
    """

    def __init__(self, make: Callable[[LeverState | None], Compiled | None]) -> None:
        self.mode = guard_mode()
        self.stats = LeverGuardStats(self)
        self.seen: set[LeverState] = set()
        self.recompiles = 0
        self.calls = 0
        self._make = make
        self._states_lock = new_lock()
        self._by_state: dict[LeverState, Callable[..., Any]] = {}
        self._single: Callable[..., Any] | None = None
        self._last: LeverState | None = None
        self._generation = 0

    def select(self) -> Callable[..., Any] | None:
        """The compiled callable for the state now (built at the state's first call)."""
        self.calls += 1
        state = lever_state()
        if self.mode == PER_STATE:
            compiled = self._by_state.get(state)
            return compiled if compiled is not None else self._build(state, state)
        generation = _PROCESS.enter(state)
        if generation != self._generation or state != self._last:
            with self._states_lock:
                if self._generation and generation != self._generation:
                    self.recompiles += 1  # its frames were forgotten: the next call compiles
                self._generation = generation
                self._last = state
                self.seen.add(state)
        return self._single if self._single is not None else self._build(None, state)

    def ran(self) -> None:
        """After each call that :meth:`select` ran (whether it returned or raised)."""
        if self.mode == RECOMPILE:
            _PROCESS.leave()

    def _build(self, key: LeverState | None, state: LeverState) -> Callable[..., Any] | None:
        with self._states_lock:
            found = self._by_state.get(state) if key is not None else self._single
            if found is not None:
                return found
            compiled = self._make(key)
            if compiled is None:
                return None
            if key is None:
                self._single = compiled
            else:
                if self._by_state:
                    self.recompiles += 1
                self._by_state[key] = compiled
                self.seen.add(key)
            return compiled
