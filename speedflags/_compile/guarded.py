"""torch.compile with a fallback to eager that never breaks a step (for ``@speedup``).

One :class:`GuardedCompile` per decorated function holds its compiled artefact, built
lazily at the first call as ``torch.compile`` does (one per state of the levers dynamo does
not guard, where PyTorch allows: :mod:`speedflags._compile.lever_guard`). Only failures of
the compiler stack (dynamo, AOT autograd, inductor, the backend) fall back: the call that
hit one still completes, nothing of it runs twice, and later calls run the plain function
without compiling again. The step's own errors are not failures, even where dynamo meets them
first (a shape mismatch fails its fake tensors): the eager error propagates, unchanged,
and the function stays compiled. The rule (:mod:`speedflags._compile.failures` applies it):
what failed is run eagerly, once; if that raises, the error is the step's. How each case is
handled (each fact probed on PyTorch 2.13; the tests inject every one of them):

- **A backend that fails on a graph.** With a graph break, a failure on the second graph
  raises after the first graph (and its side effects) ran, so retrying the whole call would
  repeat them. The user's backend is wrapped instead: a graph whose compile raises is run by
  its own ``GraphModule.forward`` (eagerly), and the call goes on. Dynamo's control-flow
  exceptions (``RestartAnalysis`` and its subclasses, which inductor raises to make dynamo
  re-trace, and ``SkipFrame``) are not failures and pass through. Dynamo traced the graph
  before the backend saw it, so a backend that raises is the compiler's failure, even when
  the call then raises an error of its own.
- **A backward graph that fails to compile.** AOT autograd compiles it lazily, inside
  ``loss.backward()``, after the forward's side effects. While the wrapped backend runs (and
  only then) ``torch._functorch.config.force_non_lazy_backward_lowering`` is patched on, so
  the backward compiles together with its forward, where the wrapper catches the failure.
- **A PyTorch that cannot compile the backward early** (2.4 has no
  ``force_non_lazy_backward_lowering``): a backward graph that fails to compile raises out
  of ``loss.backward()``, after the forward ran. That step cannot complete and raises; the
  failure is recognised (it passes through ``aot_autograd``'s backward-compiler wrapper), so
  it is reported once and later calls run eagerly instead of failing the same way. Errors
  the backward raises once compiled are the step's own.
- **A tracing error that is not a graph break** (a frame that starts after part of the call
  ran, a resume function after a graph break or a callee, must not raise one). For the
  duration of the call ``torch._dynamo.config.suppress_errors`` is on, so dynamo runs such
  a frame eagerly from its start; it is put back after the call (to the value it read, as
  an explicit setting of that value in this thread). On current PyTorch dynamo's config is
  thread-local (a ``ContextVar``), so other threads never see it; on older ones (2.4) it is
  process-wide, and other threads see it for the duration of the call. Dynamo reports the
  suppressed error in a WARNING record of the ``torch._dynamo.convert_frame`` logger, which
  a filter holds (calling thread only) until the call ends. If the call raised out of that
  eagerly run frame, the error is the step's: the record is dropped and dynamo, which
  skips such a frame for good, is let compile it again. Otherwise the record goes out and
  the call falls back. A call that fails in such a frame and also raises from it cannot
  tell the two apart; it blames the step, and the next call that completes falls back. If
  that logger is silenced below WARNING, the frame still runs eagerly and safely, but the
  fallback cannot be seen, so it is not reported.
- **An error out of a frame dynamo resumed after a graph break** (it could not compile it,
  and ran it eagerly): that frame runs on what the compiled part before it produced, and a
  compiled part that computes differently from eager code (a branch on
  ``torch.compiler.is_compiling()``, as transformers' attention-mask helpers take: on
  PyTorch 2.1.2 a float mask reaches an eager SDPA with a bf16 query) can make it raise
  where the step run eagerly does not. The call cannot be retried (its compiled part ran),
  so the error propagates, unchanged, and is taken for the step's own once (logged); raised
  by the same frame in the same way on the next call too, it is compiling's: the step falls
  back, with the warning and ``.stats`` saying so. A step's own error that repeats there
  falls back too: later calls run it eagerly, where it raises as itself.
- **Autocast a failed trace left entered** (PyTorch 2.1): ``.autocast_left`` puts the
  thread's autocast back after a compiled call that failed.
- **A tracing error before any of the call ran** (``fullgraph=True``, where dynamo traces
  the whole function first and ignores ``suppress_errors``, or an error dynamo does not
  suppress): the call is run eagerly. If that raises, the error propagates as the step's
  own (with no compiler error attached) and compiling is not given up.
- **Errors a compiled graph raises as it runs** are the step's own and propagate.
- **Nothing to compile with.** A PyTorch without ``torch.compile``, or one whose
  ``torch.compile`` refuses this platform, falls back at the first call.

Two cases cannot be told apart safely. In non-fullgraph mode dynamo lets a few errors escape
``suppress_errors`` (a failing higher-order-op body, a resume-function prologue); where part
of the call may have run by then (or the traceback, which dynamo cuts for some of them,
cannot say), the call is not retried: the error propagates, and later calls run eagerly,
even if the error was the step's. And a step that catches, inside itself, an error that
dynamo also met while tracing completes, so that is taken for a compiler failure.

The helpers live next door: :mod:`speedflags._compile.options` checks ``compile=``,
:mod:`speedflags._compile.backend` is the guarded backend, and
:mod:`speedflags._compile.failures` tells the compiler's failures from the step's errors.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from .. import _warn
from .._ledger.ledger import ledger
from .._locks import new_lock
from .._warn import PACKAGE_DIR
from ..errors import CompileFallbackWarning
from . import autocast_left
from .backend import GuardedBackend, inner_backend
from .failures import SuppressedErrors, backward_compile_failed, compile_failure, describe
from .lever_guard import LeverBackend, LeverGuard
from .lever_state import LeverState
from .options import BACKEND_KEYS, compile_options

__all__ = ["COMPILED", "FALLBACK", "PENDING", "GuardedCompile", "compile_options", "user_where"]

log = logging.getLogger("speedflags")
log.addHandler(logging.NullHandler())  # a library logs; the application decides where to

PENDING, COMPILED, FALLBACK = "pending", "compiled", "fallback"
_DYNAMO_LOGGER = "torch._dynamo.convert_frame"
_serials = itertools.count(1)
_LAZY_BACKWARD_OUTCOME = (
    "this PyTorch compiles the backward graph lazily, inside loss.backward(), so the step "
    "could not complete and raised"
)


def user_where() -> tuple[str, int] | None:
    """The file and line of the first frame outside speedflags that led here."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:  # pragma: no cover - called from speedflags only
        return None
    return (frame.f_code.co_filename, frame.f_lineno)


class GuardedCompile:
    """One function's torch.compile artefact, and the way back to eager when it fails.

    Calling it calls the function (compiled, or eagerly after a failure). ``state`` is
    ``"pending"`` until the first call sets up compilation, then ``"compiled"``, or
    ``"fallback"`` (with ``reason``) once compiling failed.
    """

    def __init__(self, func: Callable[..., Any], options: dict[str, Any], label: str) -> None:
        self.func = func
        self.options = options
        self.label = label
        self.state = PENDING
        self.reason: str | None = None
        self.levers = LeverGuard(self._make)
        self._fullgraph = bool(options.get("fullgraph", False))
        self._compile_lock = new_lock()
        self._failures: list[str] = []
        self._serial = next(_serials)
        self._dynamo_config: Any = None
        self._inner: Callable[..., Any] | None = None
        self._dynamo_log = logging.getLogger(_DYNAMO_LOGGER)
        # the last call's error out of a frame resumed after a graph break: (where, error)
        self._resumed_error: tuple[tuple[str, str, int], str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.state is FALLBACK:
            return self.func(*args, **kwargs)
        compiled = self.levers.select()  # for the state of the levers dynamo does not guard
        if compiled is None:
            return self.func(*args, **kwargs)
        autocast = autocast_left.held()  # what a failed trace may leave entered (PyTorch 2.1)
        try:
            if self._fullgraph:
                result = self._run_fullgraph(compiled, args, kwargs)
            else:
                result = self._run(compiled, args, kwargs)
            if self.state is FALLBACK:  # compiling failed in this call, which completed
                autocast_left.put_back(autocast, self.label, user_where())
            return result
        except _NothingRan as failed:
            reason = failed.reason
        except BaseException:
            autocast_left.put_back(autocast, self.label, user_where())
            raise
        finally:
            self.levers.ran()
        autocast_left.put_back(autocast, self.label, user_where())
        # Outside the handler, so that an error here, the step's own, comes with no compiler
        # error attached: it propagates as it would without compile, and nothing falls back.
        result = self.func(*args, **kwargs)
        self._fall_back(reason, "the call ran eagerly")
        return result

    # --- the two ways a call runs ----------------------------------------------------------

    def _run(self, compiled: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        config = self._dynamo_config
        watch = SuppressedErrors(threading.get_ident())
        failures = len(self._failures)
        completed = False
        prior = config.suppress_errors
        config.suppress_errors = True  # this thread, this call: see the module docstring
        self._dynamo_log.addFilter(watch)
        try:
            result = compiled(*args, **kwargs)
            completed = True
            return result
        except Exception as exc:
            if backward_compile_failed(exc) or not watch.raised_by_step(exc):
                self._blame(exc)
            else:
                self._unattributed(watch.resumed(), exc)
            raise
        finally:
            if completed:
                self._resumed_error = None
            self._dynamo_log.removeFilter(watch)
            config.suppress_errors = prior
            reason = watch.settle(self._dynamo_log)
            if reason is None and len(self._failures) > failures:
                reason = self._failures[failures]
            if reason is not None:
                self._fall_back(reason, _outcome(completed))

    def _run_fullgraph(self, compiled: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        failures = len(self._failures)
        completed = False
        try:
            result = compiled(*args, **kwargs)
            completed = True
            return result
        except Exception as exc:
            self._blame(exc)
            raise
        finally:
            if len(self._failures) > failures:
                self._fall_back(self._failures[failures], _outcome(completed))

    def _unattributed(self, resumed: tuple[str, str, int] | None, exc: Exception) -> None:
        """The call raised out of a frame dynamo could not compile and ran eagerly. If dynamo
        resumed that frame after a graph break, part of the call ran compiled before it, and
        what the frame received may differ from an eager run's (code that branches on
        ``torch.compiler.is_compiling()``, as transformers' attention-mask helpers do, built
        it): the error may be the step's own, or compiling's, and the call cannot be retried
        to tell. It is taken for the step's own, once; raised by the same frame in the same
        way on the next call too (no call completing between), it is compiling's: the step
        falls back, and later calls run eagerly."""
        if resumed is None:  # the frame from its start: its eager run was the step's
            self._resumed_error = None
            return
        seen = (resumed, describe(exc))
        if self._resumed_error != seen:
            self._resumed_error = seen
            log.warning(
                "%s: %s raised in %s (%s:%d), a frame dynamo resumed after a graph break and "
                "ran eagerly after part of the call ran compiled; taken for the step's own "
                "error. If the next call raises it there too, compiling is given up.",
                self.label, seen[1], *resumed,
            )  # fmt: skip
            return
        self._resumed_error = None
        self._fall_back(
            f"{seen[1]}, raised on two calls in a row in {resumed[0]} ({resumed[1]}:"
            f"{resumed[2]}), a frame dynamo resumed after a graph break and ran eagerly after "
            "part of the call ran compiled (a compiled part that computes differently from "
            "eager code, such as a branch on torch.compiler.is_compiling(), can make it raise "
            "where the step run eagerly does not)",
            "the call raised; it was not retried, as part of it ran compiled",
        )

    # --- setting up, and giving up ----------------------------------------------------------

    def _blame(self, exc: Exception) -> None:
        """Act on an exception out of the compiled call, unless it is the step's own error."""
        if backward_compile_failed(exc):
            why = f"the backward graph failed to compile: {describe(exc)}"
            self._fall_back(why, _LAZY_BACKWARD_OUTCOME)
            return
        ran = compile_failure(exc, self._fullgraph)
        if ran is False:
            raise _NothingRan(describe(exc))  # run eagerly: its outcome says whose error
        if ran:
            self._fall_back(
                describe(exc),
                "part of the call may have run when compiling failed, so it was not retried "
                "and raised",
            )

    def _make(self, key: LeverState | None) -> Callable[..., Any] | None:
        """torch.compile the function with a backend of its own for lever state ``key``."""
        with self._compile_lock:
            if self.state is FALLBACK:
                return None
            compile_fn = getattr(torch, "compile", None)
            if compile_fn is None:
                reason = f"PyTorch {torch.__version__} has no torch.compile"
            else:
                try:
                    import torch._dynamo as dynamo

                    top = {k: v for k, v in self.options.items() if k not in BACKEND_KEYS}
                    guard_filter = (self.options.get("options") or {}).get("guard_filter_fn")
                    if guard_filter is not None:
                        top["options"] = {"guard_filter_fn": guard_filter}
                    # Not failures: backends raise these to make dynamo re-trace (e.g.
                    # inductor's TensorifyScalarRestartAnalysis) or skip a frame.
                    signals = (dynamo.exc.RestartAnalysis, dynamo.exc.SkipFrame)
                    inner = LeverBackend(self._inner_backend(), key)
                    backend = GuardedBackend(inner, self.graph_failed, signals)
                    compiled = compile_fn(self.func, backend=backend, **top)
                    self._dynamo_config = dynamo.config
                    self.state = COMPILED
                    return compiled  # type: ignore[no-any-return]
                except Exception as exc:
                    reason = f"torch.compile cannot be set up here: {describe(exc)}"
        self._fall_back(reason, "the call ran eagerly")
        return None

    def _inner_backend(self) -> Callable[..., Any]:
        # one backend object for every lever state (inductor's keeps its own state)
        if self._inner is None:
            self._inner = inner_backend(self.options)
        return self._inner

    def graph_failed(self, exc: BaseException) -> None:
        """Called by the guarded backend when compiling one graph (or its backward) failed."""
        self._failures.append(f"the backend failed on a graph: {describe(exc)}")

    def _fall_back(self, reason: str, outcome: str) -> None:
        with self._compile_lock:
            if self.state is FALLBACK:
                return
            self.state = FALLBACK
            self.reason = reason
        message = (
            f"{self.label}: torch.compile failed ({reason}); {outcome}. Later calls run "
            "eagerly, without compiling again."
        )
        ledger().note(
            "compile",
            "fallback",
            reason,
            before="torch.compile",
            after="eager",
            label=self.label,
            where=user_where(),
        )
        log.warning(message)
        _warn.warn_once(("compile-fallback", self._serial), message, CompileFallbackWarning)


class _NothingRan(Exception):
    """Compiling failed before any of the call ran: the call runs eagerly, once."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _outcome(completed: bool) -> str:
    if completed:
        return "the call completed, running what failed eagerly"
    return "the call raised an error of its own"
