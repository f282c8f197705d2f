"""How speedflags names things to its users: a value quoted in a message, a type, a class.

``short_repr``: a user's value quoted in an error message, at most ~200 characters.

Every validation message that quotes the value it refuses goes through :func:`short_repr`,
so that ``fast_math(sdpa=["flash"] * 1_000_000)`` says what is wrong in one line instead of
building a 9 MB message. The work is bounded too: containers are walked through ``reprlib``
(a few dozen items, a few levels deep), never ``repr()``'d whole.

:func:`type_name` names a value's type as a message says "got ..."; :func:`set_module`
makes a public class name the module users import it from (``speedflags.Schedule``, not
the private module that defines it).

Torch-free and free of speedflags imports: ``errors``, the levers and the command line all
use it.

Example:
    >>> from speedflags._short_repr import short_repr
    >>> short_repr("bf17"), short_repr({"amp": "bf16", "tf32": True})
    ("'bf17'", "{'amp': 'bf16', 'tf32': True}")
    >>> shown = short_repr(["flash"] * 1_000_000)
    >>> len(shown) <= 240, shown.endswith("(1000000 items)")
    (True, True)
    >>> short_repr(10**5000)  # repr() itself raises past 4300 digits
    '<int of about 5001 digits>'
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from itertools import islice
from typing import Any, TypeVar

__all__ = ["SHOWN_CHARS", "set_module", "short_repr", "short_str", "type_name"]

_Named = TypeVar("_Named")

SHOWN_CHARS = 200  # of a value quoted in a message (a length note may follow)
_ITEMS = 24  # items of a list, tuple, set or dict shown before "..."


class _Bounded(reprlib.Repr):
    """``reprlib.Repr`` with generous limits and dicts in their own order (not sorted)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = self.maxdeque = _ITEMS
        self.maxset = self.maxfrozenset = _ITEMS
        self.maxdict = _ITEMS
        self.maxstring = self.maxlong = self.maxother = SHOWN_CHARS

    def repr_dict(self, x: Any, level: int) -> str:
        # reprlib sorts the keys; a message should show the dict as the user wrote it
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(key, level - 1)}: {self.repr1(x[key], level - 1)}"
            for key in islice(x, self.maxdict)
        ]
        more = ", ..." if len(x) > self.maxdict else ""
        return "{" + ", ".join(items) + more + "}"


_REPR = _Bounded()


def short_repr(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, with the length of a long value.

    Equal to ``repr(value)`` for the values a message usually quotes (strings, numbers,
    short lists and dicts); a longer one is cut with ``...`` and followed by its length
    (``(1000000 items)``, ``(5000 characters)``). Never raises: a value whose ``repr``
    fails is shown by its type.

    Example:
        >>> from speedflags._short_repr import short_repr
        >>> shown = short_repr("x" * 1000)
        >>> len(shown) <= 220, shown.endswith("xx' (1000 characters)")
        (True, True)
        >>> short_repr(("flash", "flash"))
        "('flash', 'flash')"
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 700:
        # repr() of an int past sys.get_int_max_str_digits() raises ValueError ("Exceeds the
        # limit for integer string conversion"), and is slow well before it
        digits = int(value.bit_length() * 0.30103) + 1
        return f"<{type(value).__name__} of about {digits} digits>"
    try:
        text = _REPR.repr(value)
    except Exception:  # a broken __repr__: say what it is, not what it holds
        return f"<{type(value).__name__} object>"
    if len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    size = _length(value)
    if isinstance(value, (str, bytes)) and size > limit:
        text += f" ({size} characters)"
    elif size > _ITEMS and isinstance(value, (list, tuple, set, frozenset, dict)):
        text += f" ({size} items)"
    return text


def short_str(text: object, limit: int = SHOWN_CHARS * 2) -> str:
    """``str(text)`` cut to at most ``limit`` characters (with its length when cut): a
    user's exception message, or a file's contents, inside one of speedflags' messages.

    Example:
        >>> from speedflags._short_repr import short_str
        >>> short_str("boom"), short_str("x" * 10_000).endswith("(10000 characters)")
        ('boom', True)
    """
    try:
        shown = str(text)
    except Exception:  # a broken __str__
        return f"<{type(text).__name__} object>"
    if len(shown) <= limit:
        return shown
    return f"{shown[: max(limit - 3, 0)]}... ({len(shown)} characters)"


def _length(value: object) -> int:
    try:
        return len(value)  # type: ignore[arg-type]
    except Exception:
        return 0


def type_name(value: object) -> str:
    """The name of ``value``'s type as an error message says "got ...": a builtin's bare
    (``bool``), any other's with its module (``numpy.bool``: NumPy 2 names its boolean scalar
    type ``bool`` too, so a bare name would read "expected True or False, got bool").

    Example:
        >>> from speedflags._short_repr import type_name
        >>> type_name(True), type_name(1.5), type_name(short_str)
        ('bool', 'float', 'function')
        >>> class Flag: ...
        >>> type_name(Flag())
        'speedflags._short_repr.Flag'
    """
    kind = type(value)
    module = getattr(kind, "__module__", "builtins")
    name = getattr(kind, "__qualname__", kind.__name__)
    if module == "builtins" or "<locals>" in name:
        return kind.__name__
    return f"{module}.{name}"


def set_module(module: str) -> Callable[[_Named], _Named]:
    """A decorator: the class (or function) it decorates reports ``module`` as its own.

    numpy's ``set_module``. Written at the definition of each public class, so that
    ``repr``, ``help()``, pickle and messages name it where users import it from
    (``speedflags.Schedule``) from the moment it exists, wherever the implementation lives.
    The public module must resolve the name (an eager import or its first-use table), or
    pickle cannot find it again. Put it above ``@dataclass``: a dataclass reads its own
    module while it is being built. A class keeps the module that defines it as
    ``_module_source`` (numpy's name), for tools that look for its source or its examples.

    Example:
        >>> from speedflags._short_repr import set_module
        >>> @set_module("speedflags")
        ... class Flag: ...
        >>> Flag.__module__, Flag._module_source, type_name(Flag())
        ('speedflags', 'speedflags._short_repr', 'speedflags.Flag')
    """

    def decorate(obj: _Named) -> _Named:
        if isinstance(obj, type):
            obj._module_source = obj.__module__  # type: ignore[attr-defined]
        obj.__module__ = module
        return obj

    return decorate
