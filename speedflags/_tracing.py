"""Keeping speedflags' bookkeeping out of torch.compile's graphs: the dynamo primitives.

While dynamo traces a function for ``torch.compile``, the Python it meets is recorded, not
run: a lock, ``sys._getframe`` or a flag setter met there is a graph break, a crash, or a
write that a graph drops (``docs/inside_compile.md`` has the measured facts, PyTorch 2.1 and 2.13).
And code that runs eagerly inside compiled code (after a graph break, in a frame dynamo
gave up on) runs with dynamo's frame hook set: each function it calls that names torch is
compiled as a frame of its own, the levers' setters included, whose writes graphs drop.
So every speedflags entry point starts with ``if is_compiling() or hooked():`` (both cheap
calls; dynamo folds the first to True when it traces), and that branch does only what
dynamo handles on every supported PyTorch:

- :func:`at_trace_time`: a function dynamo runs *for real* while tracing, once per trace,
  whose result it bakes into the graph as a constant. Validation, plans, ledger records and
  the "is this fullgraph?" question run there; the graph never sees them.
- :class:`KeptOut`: a function dynamo never traces (``torch.compiler.disable``): calling it
  is a clean graph break, and it, and everything it calls, runs eagerly with dynamo's frame
  hook off, so a lever it writes is really written and really restored.
- :func:`graph_error`: an error raised at trace time that reaches the user as itself.

Importing dynamo costs 0.6-0.8 s, so nothing here imports it before dynamo is tracing.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar, TypeVar

import torch

from .errors import SpeedflagsError

__all__ = [
    "KeptOut",
    "at_trace_time",
    "eager_where",
    "first_trace",
    "graph_error",
    "hooked",
    "is_compiling",
    "one_graph",
    "traced_where",
]

F = TypeVar("F", bound=Callable[..., Any])
Where = tuple[str, int] | None

# Found once, by feature: the cheapest function dynamo folds to True while it traces.
# torch.compiler.is_dynamo_compiling (newer PyTorch) and 2.1's torch._utils.is_compiling just
# return False when run; torch.compiler.is_compiling (2.3+, in between) reads a flag that is
# True while dynamo runs, at trace time too (and False inside a KeptOut function). Nothing
# here relies on what a real call answers. torch._dynamo.is_compiling would import dynamo.
is_compiling: Callable[[], bool] = (
    getattr(torch.compiler, "is_dynamo_compiling", None)
    or getattr(torch.compiler, "is_compiling", None)
    or torch._utils.is_compiling
)


def _no_hook() -> None:
    return None


_EVAL_FRAME = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)  # type: ignore[attr-defined, unused-ignore]
_SET_HOOK = getattr(_EVAL_FRAME, "set_eval_frame", None)


_MODULES = sys.modules


def _hook_of_2_1() -> Any:
    # PyTorch 2.1 has no getter; its setter returns the hook it replaces (what
    # torch.compiler.disable does around every call: set None, then put the prior back).
    # Both cost ~130 ns: skipped while nothing has imported dynamo (no hook without it).
    if "torch._dynamo" not in _MODULES:
        return None
    prior = _SET_HOOK(None)  # type: ignore[misc]
    _SET_HOOK(prior)  # type: ignore[misc]
    return prior


# Truthy while dynamo's frame hook is set in this thread: code torch.compile compiled is
# running, and this call runs eagerly inside it (after a graph break, or in a frame dynamo
# gave up on). Found once, by feature: the getter is PyTorch 2.2's or later.
hooked: Callable[[], Any] = getattr(_EVAL_FRAME, "get_eval_frame_callback", None) or (
    _hook_of_2_1 if _SET_HOOK is not None else _no_hook
)

# bound once: a function naming the torch module is one dynamo compiles when met eagerly
_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable

# Dynamo stores a trace-time result in the globals of the module it compiles, under the
# function's __name__ (PyTorch 2.1 overwrites whatever that name held there): a name no
# module uses.
_TRACE_TIME_NAME = "speedflags_trace_time_result"


def at_trace_time(fn: F) -> F:
    """Mark ``fn`` to be run for real while dynamo traces a call of it, its result (a tuple
    of str, bool and None) baked into the graph as a constant.

    This is what ``torch.compiler.assume_constant_result`` does (it sets this attribute and
    nothing else, PyTorch 2.1 to 2.13); set here so that ``import speedflags`` does not
    import dynamo. It runs once per trace (a recompile runs it again; dynamo may restart a
    trace, and so run it twice: :func:`first_trace`). An exception it raises reaches the
    user wrapped by dynamo, unless it is a :func:`graph_error`. Its arguments must be
    constants dynamo can read (no user objects: PyTorch 2.1 cannot pass them); a closure
    over them works instead.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    fn.__name__ = _TRACE_TIME_NAME
    return fn


def _not_prepared(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - a bug if reached
    raise AssertionError("speedflags: a KeptOut function was called before prepare()")


class KeptOut:
    """``fn``, called where dynamo does not trace it: ``torch.compiler.disable(fn)``.

    Traced code calls ``.call(...)``: a graph break; ``fn`` runs eagerly (and whatever it
    calls, dynamo's frame hook off). The disabled wrapper is made by :meth:`prepare`, which
    runs before ``.call`` is reached: in an :func:`at_trace_time` function when traced, or
    directly when :data:`hooked`.
    """

    _ALL: ClassVar[list[KeptOut]] = []

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.call: Callable[..., Any] = _not_prepared
        KeptOut._ALL.append(self)

    @classmethod
    def prepare(cls) -> None:
        """Make every disabled wrapper (at trace time: dynamo is loaded by then)."""
        for kept in cls._ALL:
            if kept.call is _not_prepared:
                kept.call = _disable(kept.fn)


def _current_tx() -> Any:
    """The instruction translator tracing now (at trace time), or None."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    if convert is None:
        return None
    current = getattr(convert.InstructionTranslator, "current_tx", None)
    if current is not None:  # PyTorch 2.2+
        try:
            return current()
        except AttributeError:  # no trace in this thread
            return None
    # 2.1: the tracer is a local ("tx") of the dynamo frame that runs an at_trace_time function
    base = convert.InstructionTranslatorBase
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        tx = frame.f_locals.get("tx")
        if isinstance(tx, base):
            return tx
        frame = frame.f_back
    return None


def one_graph() -> bool:
    """At trace time: whether a graph break is an error here (``fullgraph=True``, or 2.13's
    ``torch._dynamo.error_on_graph_break``); False when it cannot tell."""
    tx = _current_tx()
    if tx is None:
        return False
    output = tx.output
    root = getattr(output, "root_tx", tx)
    inner = getattr(output, "current_tx", tx)
    return bool(getattr(root, "one_graph", False) or getattr(inner, "error_on_graph_break", False))


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _users(filename: str) -> bool:
    return not (filename.startswith(_PACKAGE) or filename.startswith(_TORCH))


def traced_where() -> Where:
    """At trace time: the user's ``(file, line)`` that dynamo is tracing (the innermost frame
    of its traced stack outside speedflags and torch)."""
    from torch._guards import TracingContext  # loaded: dynamo is tracing

    for summary in reversed(TracingContext.extract_stack()):  # type: ignore[no-untyped-call, unused-ignore]
        if _users(summary.filename) and summary.lineno is not None:
            return (summary.filename, summary.lineno)
    return None


def eager_where() -> Where:
    """In a :class:`KeptOut` function: the user's ``(file, line)`` that called into speedflags
    (the innermost Python frame outside speedflags and torch: the disabled wrapper and
    dynamo's resume functions are skipped, the latter keep the user's file)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if _users(frame.f_code.co_filename):
            return (frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


# compilation -> the keys met in it (dynamo's CompileContext: one per frame compiled, the same
# across the restarts of its trace)
_SEEN: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def first_trace(*key: Any) -> bool:
    """At trace time: True the first time ``key`` is met in this compilation (dynamo may
    restart a trace, running each :func:`at_trace_time` function again)."""
    from torch._guards import CompileContext  # loaded: dynamo is tracing

    context: Any = CompileContext.get()  # None outside a compilation (2.13 types it without)
    try:
        seen = _SEEN.setdefault(context, set())
    except TypeError:  # None, or a context that takes no weak reference: record each trace
        return True
    if key in seen:
        return False
    seen.add(key)
    return True


_GRAPH_ERRORS: dict[type, type] = {}


def graph_error(exc: SpeedflagsError) -> BaseException:
    """``exc`` as an error dynamo lets through unchanged, to raise at trace time.

    Dynamo wraps what an :func:`at_trace_time` function raises in an
    ``InternalTorchDynamoError`` whose message alone is left (2.13 adds the type's name, 2.1
    not even that), except its own ``Unsupported`` (a graph break it cannot make), which it
    raises as it is, adding the user's traced lines to the message. So the error raised is
    an instance of a subclass of both ``type(exc)`` and ``Unsupported``: under
    ``fullgraph=True`` the user catches it as ``type(exc)`` (a
    :class:`~speedflags.SpeedflagsError` and its builtin); without, dynamo takes it for a
    graph break and runs that code eagerly, where speedflags raises ``exc`` itself.
    """
    from torch._dynamo.exc import Unsupported  # loaded: dynamo is tracing

    cls = type(exc)
    both = _GRAPH_ERRORS.get(cls)
    if both is None:

        def __init__(self: Any, message: str) -> None:
            Unsupported.__init__(self, message)  # type: ignore[no-untyped-call, unused-ignore]

        both = type(
            cls.__name__,
            (cls, Unsupported),
            {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _GRAPH_ERRORS[cls] = both
    error: BaseException = both(str(exc))
    for name, value in vars(exc).items():  # RankMismatchError's levers, ...
        setattr(error, name, value)
    return error
