"""Recognising compiler failures (for ``@speedup(compile=...)``)."""

from __future__ import annotations

import logging
from types import CodeType, TracebackType
from typing import Iterable, Optional

__all__ = ["SuppressedErrors", "backward_compile_failed", "describe"]


def describe(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, short enough for a warning.

    Example:
        >>> from speedflags._compile_failures import describe
        >>> describe(RuntimeError("no kernel for this dtype\\nmore detail"))
        'RuntimeError: no kernel for this dtype'
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and lines[1].startswith("Explanation:"):  # dynamo's errors say why here
        text = f"{text} ({lines[1]})"
    elif len(lines) > 1 and text.endswith(":"):  # "Failed running call_function ...:" + cause
        text = f"{text} {lines[1]}"
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _frames(exc: BaseException) -> Iterable[CodeType]:
    tb: Optional[TracebackType] = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def backward_compile_failed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while compiling a backward graph lazily (in backward)."""
    return any(code.co_name == "_wrapped_bw_compiler" for code in _frames(exc))  # aot_autograd's


class SuppressedErrors(logging.Filter):
    """Notes the first error dynamo suppressed in one thread (and lets the record through)."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread
        self.reason: Optional[str] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            self.reason is None
            and record.thread == self.thread
            and record.levelno >= logging.WARNING
            and record.exc_info
            and record.exc_info[1] is not None
        ):
            self.reason = f"dynamo could not compile a frame: {describe(record.exc_info[1])}"
        return True
