"""Levers of one's own: a lever from two functions (:class:`FunctionLever`), the defaults that
complete a lever written to part of the protocol (:func:`completed`), and the checks every
lever passes before the registry takes it (:func:`checked`).

A library's setting (a thread count, an inductor config value, a global of its own) gets the
built-in levers' guarantees once it is registered: ``speedflags.lever(name, read=..., write=...)``
makes a :class:`FunctionLever` (its typed block is added above, in
:mod:`speedflags._fast_math.own_lever`), and ``speedflags.register_lever(obj)`` takes an object
written to the :class:`~speedflags.levers._base.Lever` protocol, of which only ``name``,
``read`` and ``apply`` are required (the rest: :data:`DEFAULTS`).

The one rule for what a write returns: ``apply`` and ``restore`` return the state that
``read()`` answers once the write is made (read it back; return the value written only where
``read()`` is known to answer exactly it). The ledger compares that state with what ``read()``
answers at the block's exit: a difference is a change made inside the block (drift), warned
about and restored.

Example:
    >>> from speedflags.levers.own import FunctionLever
    >>> box = {"n": 1}
    >>> n = FunctionLever("n", read=lambda: box["n"], write=lambda v: box.update(n=v))
    >>> n.apply(4, n.read()), box["n"]
    (4, 4)
    >>> n.restore(1, 4), box["n"]
    (1, 1)
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Collection, Hashable
from typing import Any, Generic, TypeVar

from .._short_repr import short_repr, type_name
from ..errors import InvalidTypeError, InvalidValueError

__all__ = ["DEFAULTS", "REQUIRED", "FunctionLever", "checked", "completed"]

T = TypeVar("T")

# What a lever must have; what it may leave out, and the default the registry gives it then.
REQUIRED = ("name", "read", "apply")
DEFAULTS = {
    "domain": "its name (the state no other lever writes)",
    "scope": "'process'",
    "restore": "apply (writing a state back is writing it)",
    "check": "none: every state may be written over (checks_state False)",
    "validate": "every value accepted as it is",
    "describe": "the state as it is",
    "describe_value": "describe",
}
SCOPES = ("process", "thread")


def _same(value: Any) -> Any:
    return value


def _no_check(state: Any) -> None:
    return None


class FunctionLever(Generic[T]):
    """A lever that reads and writes one setting through two functions.

    ``read()`` answers the current value (hashable, compared with ``==``); ``write(value)``
    sets it. A write returns the state ``read()`` answers afterwards, so a setter that
    rounds or refuses quietly shows up in the history as what it did. ``validate(value)``
    (optional) returns the value to write or raises ``ValueError``/``TypeError`` saying what
    is wrong; ``values`` (optional) are the only values accepted.

    Scope: ``scope`` (``"process"``: one value for the process; ``"thread"``: one per
    thread). Restores: the value ``read()`` answered when the block was entered.

    Example:
        >>> from speedflags.levers.own import FunctionLever
        >>> mode = {"now": "a"}
        >>> lever = FunctionLever("mode", read=lambda: mode["now"],
        ...                       write=lambda v: mode.update(now=v), values=("a", "b"))
        >>> lever.validate("b"), lever.describe(lever.read())
        ('b', 'a')
    """

    __slots__ = ("_check_value", "_read", "_write", "domain", "name", "scope", "values")

    checks_state = False

    def __init__(
        self,
        name: str,
        read: Callable[[], T],
        write: Callable[[T], object],
        *,
        validate: Callable[[Any], T] | None = None,
        scope: str = "process",
        values: Collection[T] | None = None,
    ) -> None:
        call = f"lever({short_repr(name)})"
        for argument, function in (("read", read), ("write", write), ("validate", validate)):
            if function is not None and not callable(function):
                raise InvalidTypeError(
                    f"{call}: {argument}={short_repr(function)} is not callable; expected a "
                    f"function{' taking no argument' if argument == 'read' else ' of a value'}"
                )
        if values is not None:
            if isinstance(values, (str, bytes)) or not isinstance(values, Collection):
                raise InvalidTypeError(
                    f"{call}: values={short_repr(values)}: expected a collection of the "
                    "accepted values, such as a tuple"
                )
            values = tuple(values)
        self.name = name
        self.domain = name
        self.scope = scope
        self.values: tuple[T, ...] | None = values
        self._read = read
        self._write = write
        self._check_value = validate

    def read(self) -> T:
        """The setting's value now."""
        return self._read()

    def apply(self, value: T, before: Any = None) -> T:
        """Write ``value``; return what ``read()`` answers afterwards."""
        self._write(value)
        return self._read()

    restore = apply  # writing a value back is writing it

    def check(self, state: Any) -> None:
        """Every value may be written over (nothing to refuse)."""
        return None

    def validate(self, value: Any) -> T:
        """The value to write: ``validate(value)``'s answer, and one of ``values`` if given."""
        if self._check_value is not None:
            value = self._check_value(value)
        if self.values is not None and value not in self.values:
            valid = ", ".join(repr(v) for v in self.values)
            raise InvalidValueError(f"{short_repr(value)} is not accepted; valid: {valid}")
        return value  # type: ignore[no-any-return]

    def describe(self, state: Any) -> Any:
        """The state as it is (a number, a string, ...)."""
        return state

    describe_value = describe

    def __repr__(self) -> str:
        return f"<lever {self.name} ({self.scope})>"


class _Completed:
    """A lever written to part of the protocol, with the defaults (:data:`DEFAULTS`) for the
    rest: the ledger then sees the whole protocol. Its members are the lever's own bound
    methods (no call in between), read once, at registration."""

    def __init__(self, lever: Any) -> None:
        self.lever = lever  # the object written by its author, for the optional attributes
        self.name: str = lever.name
        self.domain: str = getattr(lever, "domain", lever.name)
        self.scope: str = getattr(lever, "scope", "process")
        self.read = lever.read
        self.apply = lever.apply
        self.restore = getattr(lever, "restore", lever.apply)
        check = getattr(lever, "check", None)
        self.checks_state: bool = bool(getattr(lever, "checks_state", check is not None))
        self.check = check if check is not None else _no_check
        self.validate = getattr(lever, "validate", _same)
        self.describe = getattr(lever, "describe", _same)
        self.describe_value = getattr(lever, "describe_value", self.describe)

    def __getattr__(self, name: str) -> Any:
        # the optional attributes the registry reads (available, summary, baseline, ...)
        return getattr(self.__dict__["lever"], name)

    def __repr__(self) -> str:
        return repr(self.lever)


def completed(lever: Any) -> Any:
    """``lever`` itself if it has every member of the protocol, else ``lever`` with the
    defaults (:data:`DEFAULTS`) for those it leaves out.

    Raises:
        InvalidTypeError: it lacks a required member (``name``, ``read``, ``apply``), or a
            method it has is not callable.

    Example:
        >>> from speedflags.levers.own import completed
        >>> class Knob:
        ...     name = "knob"
        ...     value = 0
        ...     def read(self): return self.value
        ...     def apply(self, value, before): self.value = value; return self.read()
        >>> knob = completed(Knob())
        >>> knob.domain, knob.scope, knob.restore(3, 0), knob.describe(knob.read())
        ('knob', 'process', 3, 3)
    """
    lacks = [member for member in REQUIRED if not hasattr(lever, member)]
    if lacks:
        raise InvalidTypeError(
            f"{short_repr(lever)} is not a lever: it has no {', '.join(lacks)}; a lever "
            "has name, read() and apply(value, before) at least (docs/your_own_levers.md)"
        )
    methods = ("read", "apply", "restore", "check", "validate", "describe", "describe_value")
    uncallable = [m for m in methods if hasattr(lever, m) and not callable(getattr(lever, m))]
    if uncallable:
        raise InvalidTypeError(
            f"{short_repr(lever)} is not a lever: its {', '.join(uncallable)} is not callable"
        )
    if all(hasattr(lever, member) for member in (*DEFAULTS, "checks_state")):
        return lever
    return _Completed(lever)


def checked(call: str, lever: Any) -> None:
    """Refuse a lever whose name, scope or domain the ledger cannot take, or whose ``read()``
    does not answer (called once, here: a setting that cannot be read cannot be restored).

    Raises:
        InvalidValueError: the name is not a keyword argument name, the scope is neither
            ``"process"`` nor ``"thread"``, the domain is empty, or ``read()`` raises.
        InvalidTypeError: ``read()`` answers a value that is not hashable.
    """
    name, scope, domain = lever.name, lever.scope, lever.domain
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidValueError(
            f"{call}: the name {short_repr(name)} is not a keyword argument name"
        )
    if scope not in SCOPES:
        raise InvalidValueError(f"{call}: scope {short_repr(scope)}; valid: 'process', 'thread'")
    if not isinstance(domain, str) or not domain:
        raise InvalidValueError(f"{call}: domain {short_repr(domain)}: expected a name")
    try:
        state = lever.read()
    except Exception as exc:
        raise InvalidValueError(
            f"{call}: read() raised {type(exc).__name__}: {exc}; a lever's read() must answer "
            "the setting's value (the state a block restores)"
        ) from exc
    if not isinstance(state, Hashable) or _unhashable(state):
        raise InvalidTypeError(
            f"{call}: read() answered {short_repr(state)}, a {type_name(state)}, which is not "
            "hashable; a state is compared and kept as it is: answer a tuple, not a list"
        )


def _unhashable(state: Any) -> bool:
    try:
        hash(state)
    except TypeError:
        return True
    return False
