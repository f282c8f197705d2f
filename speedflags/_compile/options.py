"""Checking ``compile=`` (``@speedup``): the ``torch.compile`` options, before anything runs."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .._short_repr import short_repr
from ..errors import InvalidTypeError, InvalidValueError

__all__ = ["BACKEND_KEYS", "compile_options"]

# What each torch.compile option must be (checked at decoration; torch checks the rest).
_OPTION_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "fullgraph": ((bool,), "True or False"),
    "dynamic": ((bool, type(None)), "True, False or None"),
    "mode": ((str, type(None)), "a mode name or None"),
    "options": ((dict, type(None)), "a dict of backend options or None"),
    "disable": ((bool,), "True or False"),
}
# Options that configure the backend (inductor's mode and options); the rest go to torch.compile.
BACKEND_KEYS = ("backend", "mode", "options")


def _compile_keys() -> tuple[str, ...]:
    compile_fn = getattr(torch, "compile", None)
    if compile_fn is None:
        return ("backend", "disable", "dynamic", "fullgraph", "mode", "options")
    return tuple(sorted(p for p in inspect.signature(compile_fn).parameters if p != "model"))


def compile_options(
    value: object, call: str = "speedup", shown: str | None = None
) -> dict[str, Any] | None:
    """Validate a ``compile=`` argument: ``None`` for off, else the torch.compile options.

    Touches no torch state. Option names are checked against ``torch.compile``'s signature,
    the common options' types, and a backend name against dynamo's registry. Errors start
    with ``shown``, by default ``"speedup(compile=...)"``.

    Example:
        >>> from speedflags._compile.options import compile_options
        >>> compile_options(False), compile_options(True), compile_options({"fullgraph": True})
        (None, {}, {'fullgraph': True})
    """
    if value is False:
        return None
    if value is True:
        return {}
    if shown is None:
        shown = f"{call}(compile={short_repr(value)})"
    if not isinstance(value, dict):
        raise InvalidTypeError(
            f"{shown}: expected True, False or a dict of torch.compile options, "
            f"got {type(value).__name__}"
        )
    known = _compile_keys()
    options = dict(value)
    for key, option in options.items():
        if key not in known:
            raise InvalidValueError(
                f"{shown}: unknown torch.compile option {short_repr(key)}; "
                f"valid: {', '.join(known)}"
            )
        if key in _OPTION_TYPES:
            types, expected = _OPTION_TYPES[key]
            if not isinstance(option, types):
                raise InvalidTypeError(
                    f"{shown}: {short_repr(key)} must be {expected}, got {type(option).__name__}"
                )
    if options.get("mode") is not None and options.get("options") is not None:
        raise InvalidValueError(
            f"{shown}: torch.compile takes 'mode' or 'options', not both; "
            "put the mode's settings in 'options'"
        )
    backend = options.get("backend")
    if backend is not None and not callable(backend):
        if not isinstance(backend, str):
            raise InvalidTypeError(
                f"{shown}: 'backend' must be a backend name or a callable, "
                f"got {type(backend).__name__}"
            )
        registered = _registered_backends()
        if registered is not None and backend not in registered:
            raise InvalidValueError(
                f"{shown}: torch.compile has no backend {short_repr(backend)}; registered: "
                f"{', '.join(registered)}"
            )
    return options


def _registered_backends() -> list[str] | None:
    # Importing dynamo is what torch.compile does at decoration too; where it cannot be
    # imported, the name is not checked here and the first call falls back with the reason.
    try:
        import torch._dynamo as dynamo

        return list(dynamo.list_backends(exclude_tags=()))
    except Exception:
        return None
