"""Turn a frame scope into a decorator for any kind of callable: the frame per call or per step.

Plain functions get one frame per call. Generator, coroutine and async-generator functions
get one frame per *step*: the levers hold while the body runs and are restored whenever it
suspends at a ``yield`` or ``await``, so code that runs in between (the consumer of a
generator, other tasks on the event loop) never sees them. This is what
``torch.no_grad``'s generator support does; ``contextlib.ContextDecorator`` instead wraps only
the creation of the generator or coroutine object (CPython gh-125862).

Inside ``torch.compile`` (a plain function called by traced code, or compiled itself), the
wrapper hands the call to its ``in_graph`` branch (:mod:`speedflags._tracing`): dynamo never
traces the frame bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import AsyncGenerator, Callable, Generator
from contextlib import AbstractContextManager
from typing import (
    TYPE_CHECKING,
    Any,
    TypeVar,
)

from .._short_repr import short_repr
from .._tracing import KeptOut, Where, at_trace_time, eager_where, hooked, is_compiling
from ..errors import InvalidTypeError, SpeedflagsError
from .entering import call_framed, close_left_open
from .interrupts import PENDING, critical, deliver_pending

if TYPE_CHECKING:
    from .protocol import Scope
    from .suspend import Suspended

F = TypeVar("F", bound=Callable[..., Any])
# what a plain function's wrapper does while dynamo traces it: (func, args, kwargs) -> result
InGraph = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_getframe = sys._getframe


def caller_where(depth: int = 2) -> Where:
    """``(filename, lineno)`` of the frame ``depth`` levels above the caller of this function."""
    try:
        f = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallower stack than expected
        return None
    return (f.f_code.co_filename, f.f_lineno)


def decorate(
    func: F,
    scope: Scope,
    what: str,
    label: str,
    step_guard: Callable[[], AbstractContextManager[Any]] | None = None,
    in_graph: InGraph | None = None,
    call: Callable[..., Any] | None = None,
    counter: Any = None,
) -> F:
    """Wrap ``func`` so that each call (or each step) runs inside a frame of ``scope``,
    labelled ``label`` (``what`` names the decorator in errors).

    ``step_guard``, for generator and coroutine functions, makes a context manager entered
    around each step inside its frame (``@speedup(inference=True)``'s inference mode);
    entered and exited in C, it cannot be left half-entered by an interruption. ``in_graph``
    is what a plain function's wrapper does while dynamo traces it (default: the call,
    eagerly in a frame, a graph break). ``call``, for a plain function, is what each call
    runs instead of ``func`` (``@speedup``'s compiled step; the wrapper keeps ``func``'s
    name and signature). ``counter``: an object whose ``calls`` each call (or step)
    increments (``@speedup``'s stats).
    """
    if isinstance(func, type):
        raise InvalidTypeError(
            f"{what} cannot decorate the class {func.__qualname__!r}: it is ambiguous whether "
            "the constructor or every method should run with the levers; decorate the methods"
        )
    if isinstance(func, (staticmethod, classmethod)):
        return type(func)(
            decorate(func.__func__, scope, what, label, step_guard, in_graph, call, counter)
        )
    if not callable(func):
        raise InvalidTypeError(f"{what} can only decorate a callable, got {short_repr(func)}")

    driver = _Driver(scope, label, step_guard, counter)
    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def async_gen_wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            where = caller_where()
            to_send: Any = None
            to_throw: BaseException | None = None
            agen = func(*args, **kwargs)
            held = suspended(agen)  # what its body holds across each yield and await
            try:
                while True:
                    if to_throw is not None:
                        step = agen.athrow(to_throw)
                        to_throw = None
                    else:
                        step = agen.asend(to_send)
                    try:  # the step's StopIteration is a yield: the body suspends
                        item = await _Stepped(step.__await__(), driver, where, held, True)
                    except StopAsyncIteration:
                        return
                    try:
                        to_send = yield item
                    except GeneratorExit:
                        # closed early by the consumer: the generator's cleanup runs
                        # with the levers, like every other step
                        await _Stepped(agen.aclose().__await__(), driver, where, held)
                        raise
                    except BaseException as exc:
                        to_throw = exc
            finally:
                # whatever ended the loop (even a step that failed inside speedflags), the
                # wrapped generator is closed and its cleanup runs (inside the blocks it
                # holds, set aside at its last yield, when they can be opened again)
                if not agen.ag_running and held.frames and agen.ag_frame is not None:
                    try:
                        await _Stepped(agen.aclose().__await__(), driver, where, held)
                    except Exception:  # its cleanup's own error, or the blocks refused
                        if agen.ag_frame is None:
                            raise
                if not agen.ag_running:
                    await agen.aclose()  # closed already: nothing to do

        return async_gen_wrapper  # type: ignore[return-value]

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def coroutine_wrapper(*args: Any, **kwargs: Any) -> Any:
            where = caller_where()
            body = func(*args, **kwargs)
            held = suspended(body)
            return await _Stepped(body.__await__(), driver, where, held)

        return coroutine_wrapper  # type: ignore[return-value]

    if inspect.isgeneratorfunction(func):

        @functools.wraps(func)
        def generator_wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            it = func(*args, **kwargs)
            return (yield from _steps(it, driver, caller_where(), suspended(it)))

        return generator_wrapper  # type: ignore[return-value]

    target = func if call is None else call
    traced = _framed_in_graph(scope, label) if in_graph is None else in_graph

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling() or hooked():  # inside torch.compile: traced, or eager in it
            return traced(target, args, kwargs)
        if counter is not None:
            counter.calls += 1
        caller = _getframe(1)
        return call_framed(
            scope, label, target, args, kwargs, (caller.f_code.co_filename, caller.f_lineno)
        )

    return own_code(wrapper)  # type: ignore[return-value]


def suspended(body: Any) -> Suspended:
    """A new :class:`~.suspend.Suspended`, for ``body``, one call of a decorated generator or
    coroutine (its module loads at the first such call: ``import speedflags`` needs none)."""
    from .suspend import Suspended

    return Suspended(body)


def own_code(wrapper: F) -> F:
    """``wrapper`` with a code object of its own (equal to the one it shares with every other
    wrapper). Dynamo keeps its compiled variants per code object, at most 8 (then runs the
    code eagerly, compiling what it calls: the ledger's lever writes, which graphs drop), and
    each decorated function is a variant of the shared code: one code each, one cache each.
    """
    wrapper.__code__ = wrapper.__code__.replace()
    return wrapper


def _call_framed_here(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    scope: Scope,
    label: str,
) -> Any:
    return call_framed(scope, label, func, args, kwargs, eager_where())


# A decorated call met by dynamo, run eagerly (a graph break): the levers really in force.
FRAMED = KeptOut(_call_framed_here)


@at_trace_time
def _prepared() -> tuple[()]:
    KeptOut.prepare()
    return ()


def _framed_in_graph(scope: Scope, label: str) -> InGraph:
    def in_graph(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_compiling():
            _prepared()
        else:
            KeptOut.prepare()
        return FRAMED.call(func, args, kwargs, scope, label)

    return in_graph


class _Driver:
    """What a generator's or coroutine's steps are run with: the scope whose frames hold
    them, their label, a guard entered around each step inside its frame, and a counter."""

    __slots__ = ("counter", "guard", "label", "ledger", "scope")

    def __init__(
        self,
        scope: Scope,
        label: str,
        guard: Callable[[], AbstractContextManager[Any]] | None,
        counter: Any,
    ) -> None:
        self.scope = scope
        self.label = label
        self.guard = guard
        self.counter = counter
        self.ledger = scope.ledger


def _steps(
    it: Any, driver: _Driver, where: Where, held: Suspended, stop_yields: bool = False
) -> Generator[Any, Any, Any]:
    """Drive a generator-like ``it`` (send/throw/close), one frame around every step.

    ``held`` keeps what the body holds across each suspension (:mod:`.suspend`);
    ``stop_yields``: ``it`` is an async generator's ``asend``/``athrow``, whose
    ``StopIteration`` is a ``yield`` of the body, not its end.
    """
    to_send: Any = None
    to_throw: BaseException | None = None
    try:
        while True:
            try:
                if to_throw is not None:
                    exc, to_throw = to_throw, None
                    item = _step(driver, where, held, stop_yields, it.throw, exc)
                else:
                    item = _step(driver, where, held, stop_yields, it.send, to_send)
            except StopIteration as stop:
                return stop.value
            try:
                to_send = yield item
            except GeneratorExit:
                _step(driver, where, held, None, it.close)
                raise
            except BaseException as exc:
                to_throw = exc
    except BaseException:
        _finish_held(it, driver, where, held)
        raise


def _finish_held(it: Any, driver: _Driver, where: Where, held: Suspended) -> None:
    # _finish, inside the blocks the body holds (set aside when it last suspended, or as the
    # step that failed ended) when they can be opened again: its cleanup exits them as it
    # would have; else (refused again: the TF32 state is still mixed) without them
    if held.frames and held.alive():
        with contextlib.suppress(Exception):  # _finish lets none of the body's out
            _step(driver, where, held, None, _finish, it)
            return
    _finish(it)


def _finish(it: Any) -> None:
    # The wrapper ends with an exception: ``it`` can never be resumed. If the exception did
    # not come from it (a frame's open or close failed or was interrupted between two of its
    # steps), finish it now rather than in the garbage collector: an exception raised by its
    # cleanup (a second Ctrl-C) then reaches the caller instead of being "ignored", and an
    # async generator left suspended inside a step is no longer "already running" for its
    # aclose(). GeneratorExit is what close() throws; unlike close(), throwing it also ends
    # an async generator's step (asend, athrow). Thrown into an ``it`` that has finished, it
    # comes back as itself or as "cannot reuse already awaited" RuntimeError: nothing to do.
    try:
        it.throw(GeneratorExit)
    except (GeneratorExit, Exception):  # closed, finished already, or its cleanup failed
        return
    it.close()  # its cleanup yielded again: closed without it


def _step(
    driver: _Driver,
    where: Where,
    held: Suspended,
    stop_yields: bool | None,
    advance: Callable[..., Any],
    *args: Any,
) -> Any:
    """``advance(*args)`` (one step of a generator or coroutine) inside its own frame.

    Opened and closed as a decorated plain call is: a frame whose open returned into an
    interruption is found by its owner and closed (``close_left_open``); a close interrupted at
    its first instruction (a plain signal handler) is made again. The close itself runs in
    ``_end_step``, critical code: a :func:`~speedflags.signal_safe` handler called in it
    waits until the frame is closed, and runs there.

    A step that ends with the body suspended (``advance`` returned, or raised the
    ``StopIteration`` of an async generator's ``yield``: ``stop_yields``; ``None`` for a
    close, which ends the body) sets aside what the body holds (``held``); the next step
    puts it back once its frame is open.
    """
    mark = driver.ledger.stacks.last_id
    frame = None
    ends = RAISED  # until the step says otherwise: an exception (an interruption) ends it
    try:
        if driver.counter is not None:
            driver.counter.calls += 1
        frame = driver.scope.open_frame(driver.label, where)
        if held:
            held.resume(driver.ledger, frame, where)
        guard = driver.guard
        if guard is None:
            item = advance(*args)
        else:
            with guard():
                item = advance(*args)
        ends = RETURNED if stop_yields is None else SUSPENDED
        return item
    except StopIteration:
        ends = SUSPENDED if stop_yields is True else RETURNED
        raise
    finally:
        try:
            _end_step(driver, mark, frame, where, held, ends)
        except SpeedflagsError:
            raise
        except BaseException:  # interrupted before its try: end the step now
            _end_step(driver, mark, frame, where, held, ends)
            raise


# How a step ended: the body suspended (at a yield or await), returned (or was closed), or an
# exception ended the step: the body's own, or an interruption of the step's own work (while
# its frame or the blocks the body holds were opened or closed)
SUSPENDED, RETURNED, RAISED = "suspended", "returned", "raised"


@critical
def _end_step(
    driver: _Driver, mark: int, frame: Any, where: Where, held: Suspended, ends: str
) -> None:
    # No frame: the open failed, or returned into an interruption (its frame is found by its
    # owner). A frame closed already: an earlier try got that far before being interrupted.
    # Suspended: what the body holds is set aside first, its frames and its own states, kept
    # for its next step. Raised: its frames open above the step's are set aside and kept (if
    # the body is still suspended, its finishing reopens them so that its exits close them;
    # if it has ended, an exit of theirs was interrupted, and they stay closed); the step's
    # close raises no order error in the exception's place. Returned: a frame left open
    # above is an order error, as for a decorated call.
    try:
        if frame is None:
            close_left_open(driver.ledger, driver.scope, where, opened_after=mark)
        elif not frame.closed:
            if ends is not RETURNED:
                held.suspend(driver.ledger, frame, where, ends is SUSPENDED)
            driver.ledger.close(frame, where)
    finally:  # signal_safe handlers deferred in here
        while True:  # the drain (interrupts.py): no check point after its last test
            if not PENDING:
                break
            deliver_pending()


class _Stepped:
    """An awaitable that runs another awaitable's iterator one frame per step."""

    __slots__ = ("_driver", "_held", "_it", "_stop_yields", "_where")

    def __init__(
        self, it: Any, driver: _Driver, where: Where, held: Suspended, stop_yields: bool = False
    ):
        self._it = it
        self._driver = driver
        self._where = where
        self._held = held
        self._stop_yields = stop_yields

    def __await__(self) -> Generator[Any, Any, Any]:
        return _steps(self._it, self._driver, self._where, self._held, self._stop_yields)
