"""Warnings emitted once per cause, pointing at the user's line."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Hashable
from types import FrameType

# speedflags' own directory: frames in it (any subpackage) are never the user's line
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_seen: set[Hashable] = set()
_lock = threading.Lock()
_MAX_CAUSES = 10_000  # a drifting training loop must not grow this set without bound


def user_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn`` at the first frame outside speedflags."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def warn_once(cause: Hashable, message: str, category: type[Warning]) -> bool:
    """Warn unless ``cause`` was warned about before in this process; True if it warned."""
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
