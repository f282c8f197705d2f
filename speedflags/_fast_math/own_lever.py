"""``speedflags.lever``: a setting of one's own, from the function that reads it and the one
that writes it, as a lever like the built-in ones and as its own typed block.

The lever (:class:`OwnLever`) is the levers layer's :class:`~speedflags.levers.FunctionLever`
(what the ledger reads, writes and restores), registered, with a call that makes its block:
``num_threads(1)`` is ``fast_math(num_threads=1)``, typed by the value ``read`` answers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Literal, TypeVar

from .._short_repr import set_module, short_repr
from .._tracing import hooked, is_compiling
from ..levers.own import FunctionLever
from ..levers.registry import register
from . import FastMath
from .in_graph import BUILDERS, spec_in_graph

__all__ = ["OwnLever", "lever"]

T = TypeVar("T")


@set_module("speedflags")
class OwnLever(FunctionLever[T]):
    """A lever made by :func:`speedflags.lever`: registered, and its own block.

    ``lever(value)`` is a :class:`~speedflags.FastMath` spec with this lever alone
    (``with num_threads(1):``, ``@num_threads(1)``); beside other levers it is a keyword of
    ``fast_math``, ``@speedup`` and ``Schedule`` entries under its name
    (:meth:`keyword`). A type checker reads the value's type from ``read``.

    Scope: its ``scope`` (``"process"`` or ``"thread"``). Restores: the value ``read()``
    answered when the block was entered.

    Example:
        >>> import speedflags
        >>> box = {"size": 8}
        >>> size = speedflags.lever("size", read=lambda: box["size"],
        ...                         write=lambda value: box.update(size=value))
        >>> with size(32):
        ...     box["size"]
        32
        >>> box["size"]
        8
        >>> speedflags.unregister_lever("size")
    """

    __slots__ = ()

    def __call__(self, value: T, /, *, label: str | None = None, strict: bool = False) -> FastMath:
        """A block with this lever set to ``value``: ``fast_math(<name>=value)``, a context
        manager and a decorator (``label`` and ``strict`` as ``fast_math``'s; the label
        defaults to ``"<name>(<value>)"``)."""
        if is_compiling() or hooked():  # inside torch.compile: built out of dynamo's way
            return spec_in_graph(BLOCK, (self.name, value, label, strict), {})  # type: ignore[no-any-return]
        return _block(self.name, value, label, strict)

    def keyword(self, value: T) -> dict[str, Any]:
        """``{<name>: value}``, the keyword this lever is beside others, typed:
        ``fast_math(tf32=True, **num_threads.keyword(1))``, ``@speedup(**...)``."""
        return {self.name: value}


def _block(name: str, value: Any, label: str | None, strict: bool) -> FastMath:
    # a lever's own block: fast_math(<name>=value), labelled "<name>(<value>)"
    shown = f"{name}({short_repr(value)})" if label is None else label
    return FastMath(label=shown, strict=strict, **{name: value})


BLOCK = "lever of one's own"
BUILDERS[BLOCK] = _block  # what a lever's call builds at trace time (in_graph.spec_in_graph)


def lever(
    name: str,
    read: Callable[[], T],
    write: Callable[[T], object],
    *,
    validate: Callable[[Any], T] | None = None,
    scope: Literal["process", "thread"] = "process",
    values: Collection[T] | None = None,
) -> OwnLever[T]:
    """Make a setting of one's own a lever: ``read()`` answers its value, ``write(value)``
    sets it. The lever is registered (a keyword of ``fast_math``, ``@speedup``, ``Schedule``,
    shown by ``snapshot()``, ``report`` and the pytest plugin's leak check) and is its own
    context manager and decorator: ``with num_threads(1):``.

    Every block restores the value ``read()`` answered at its entry, nests, records its set
    and restore in the history, and warns (:class:`~speedflags.DriftWarning`) when code inside
    it changed the setting. A write's result is what ``read()`` answers after it: a setter
    that rounds or clamps is recorded as what it did.

    Args:
        name: its keyword (an identifier no other lever and no ``fast_math`` argument has).
        read: answers the value now (hashable: compared with ``==`` and kept as is).
            Called once here: a ``read`` that raises is refused.
        write: sets a value (its return value is ignored).
        validate: returns the value to write, or raises ``ValueError``/``TypeError`` saying
            what is wrong (at the block's creation, before anything changes). Default:
            every value.
        scope: ``"process"`` (one value for the process, such as a thread count) or
            ``"thread"`` (one per thread).
        values: the values accepted (others are refused, naming these).

    Returns:
        The lever (:class:`OwnLever`), typed by the value ``read`` answers.

    Raises:
        InvalidTypeError: ``read``, ``write`` or ``validate`` is not callable, or ``read()``
            answers a value that is not hashable.
        InvalidValueError: the name is taken (a built-in lever, another registered one, an
            argument of ``fast_math``) or not an identifier, the scope is not one of the two,
            or ``read()`` raises.

    An installed package declares its levers under the entry-point group
    ``speedflags.levers`` (``docs/your_own_levers.md``); they are then known by name
    without being imported.

    Example:
        >>> import torch, speedflags
        >>> num_threads = speedflags.lever(
        ...     "num_threads", read=torch.get_num_threads, write=torch.set_num_threads)
        >>> before = torch.get_num_threads()
        >>> with num_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
        >>> speedflags.unregister_lever("num_threads")
    """
    made: OwnLever[T] = OwnLever(name, read, write, validate=validate, scope=scope, values=values)
    register(made, f"lever({name!r})")
    return made
