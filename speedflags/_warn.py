"""Warnings emitted once per cause, pointing at the user's line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from types import FrameType

from ._locks import new_lock

# speedflags' own directory: frames in it (any subpackage) are never the user's line
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_seen: set[Hashable] = set()
_lock = new_lock()
_MAX_CAUSES = 10_000  # a drifting training loop must not grow this set without bound


def user_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn`` at the first frame outside speedflags."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


# categories said nowhere in this thread or task for now (quiet()); per context, so a tool
# measuring on purpose silences only its own blocks
_QUIET: ContextVar[tuple[type[Warning], ...]] = ContextVar("speedflags_quiet", default=())


@contextlib.contextmanager
def quiet(*categories: type[Warning]) -> Iterator[None]:
    """Within it, :func:`warn_once` says nothing of ``categories`` in this thread or task,
    and does not count the cause as said (a later one outside says it)."""
    token = _QUIET.set(_QUIET.get() + categories)
    try:
        yield
    finally:
        _QUIET.reset(token)


def warn_once(cause: Hashable, message: str, category: type[Warning]) -> bool:
    """Warn unless ``cause`` was warned about before in this process (or ``category`` is
    :func:`quiet` here); True if it warned."""
    quieted = _QUIET.get()
    if quieted and issubclass(category, quieted):
        return False
    with _lock:
        if cause in _seen:
            return False
        if len(_seen) < _MAX_CAUSES:
            _seen.add(cause)
    warnings.warn(message, category, stacklevel=user_stacklevel())
    return True


def log_once(cause: Hashable, message: str) -> bool:
    """Log ``message`` at INFO on the ``speedflags`` logger unless ``cause`` was seen before:
    for what is worth knowing but is nobody's mistake (never a warning, so never an error
    under ``-W error``). True if it logged."""
    with _lock:
        if cause in _seen:
            return False
        if len(_seen) < _MAX_CAUSES:
            _seen.add(cause)
    logging.getLogger("speedflags").info(message)
    return True


def _forget() -> None:
    # For tests: forget which causes were warned about.
    with _lock:
        _seen.clear()


def measuring() -> contextlib.AbstractContextManager[None]:
    """Blocks planned inside do not warn of emulated or device-less levers
    (``SlowPathWarning``, ``DeviceUnavailableWarning``): for the tools (``bench``, ``tune``,
    ``verify``) that enter such levers on purpose and say what they cost in their own output.
    Per thread and task (:func:`quiet`).

    Example:
        >>> import warnings, speedflags
        >>> from speedflags._warn import measuring
        >>> with warnings.catch_warnings(record=True) as caught, measuring():
        ...     warnings.simplefilter("always")
        ...     with speedflags.fast_math(amp="fp16", device="cpu", label="on purpose"):
        ...         pass
        >>> [w for w in caught if issubclass(w.category, speedflags.SpeedflagsWarning)]
        []
    """
    from .errors import DeviceUnavailableWarning, SlowPathWarning  # local: a base module too

    return quiet(SlowPathWarning, DeviceUnavailableWarning)
