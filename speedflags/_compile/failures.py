"""Whose error it is (for ``@speedup(compile=...)``): the compiler stack's, or the step's own.

The rule: a failure is the compiler's only if what failed, run eagerly, does not raise. Dynamo
meets many of the step's own errors first (a shape mismatch fails its fake tensors), and
raises or suppresses them as its own; the eager run then raises the step's error, unchanged.
How a call's exception is placed (each fact probed on PyTorch 2.13):

- It passed through a frame that dynamo could not compile, suppressed and ran eagerly
  (:class:`SuppressedErrors` knows those frames from dynamo's ``WON'T CONVERT`` record):
  the eager run raised, so it is the step's error. Dynamo skips such a frame for good;
  :func:`recompile` lets it be compiled again.
- It was raised while dynamo compiled a frame (a frame of ``torch/_dynamo/convert_frame.py``
  is in its traceback) and no frame outside dynamo ran before: nothing of the call ran, so
  the call can be run eagerly to find out (:func:`compile_failure` says ``False``). With
  ``fullgraph=True`` the same holds for any dynamo error, as dynamo traces the whole
  function before running any of it (and cuts its own frames off some errors).
- Dynamo's error after part of the call ran, or whose traceback was cut: it cannot be
  repeated (``True``).
- Anything else was raised while the step ran (eagerly, or by a compiled graph): the
  step's own (``None``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from types import CodeType, TracebackType

import torch

from .._warn import PACKAGE_DIR

__all__ = ["SuppressedErrors", "backward_compile_failed", "compile_failure", "describe"]

_DYNAMO_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo") + os.sep
_CONVERT_FRAME = _DYNAMO_DIR + "convert_frame.py"
# dynamo's record of a frame it gives up on: "WON'T CONVERT <name> <file> line <first line>";
# the name of a resume function has spaces in PyTorch 2.1 ("<resume in train>")
_WONT_CONVERT = re.compile(r"WON'T CONVERT (<[^>]*>|\S+) (.+?) line (\d+)")
_Where = tuple[str, str, int]
# the names dynamo gives the frames it resumes after a graph break (2.1; 2.2 and later)
_RESUME_NAMES = ("<resume in ", "torch_dynamo_resume_in_")


def describe(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, short enough for a warning.

    Example:
        >>> from speedflags._compile.failures import describe
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
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def backward_compile_failed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while compiling a backward graph lazily (in backward)."""
    return any(code.co_name == "_wrapped_bw_compiler" for code in _frames(exc))  # aot_autograd's


def compile_failure(exc: BaseException, fullgraph: bool) -> bool | None:
    """Whether ``exc`` is a compiler failure, and whether part of the call may have run.

    ``None``: it is not (the step's own error); ``False``: compiling failed before any of
    the call ran; ``True``: part of the call may have run by then.
    """
    compiling = ran = False
    for code in _frames(exc):
        if code.co_filename == _CONVERT_FRAME:
            compiling = True
            break
        if not code.co_filename.startswith((_DYNAMO_DIR, PACKAGE_DIR)):
            ran = True  # a frame outside dynamo was running: the step's code, for real
    if compiling and not ran:
        return False
    from torch._dynamo.exc import TorchDynamoException

    if not (isinstance(exc, TorchDynamoException) or (compiling and fullgraph)):
        return None
    # Dynamo's error after part of the call ran, or without its frames: dynamo's entry cuts
    # them off some errors (PyTorch 2.13 does). Only fullgraph says that nothing ran then.
    return not fullgraph


def recompile(codes: Iterable[CodeType]) -> None:
    """Let dynamo compile these frames again (after a suppressed error it skips them for good)."""
    import torch._dynamo.eval_frame as eval_frame

    # clears a code's compiled entries and its skip mark; dynamo's own reset uses it
    reset_code = getattr(eval_frame, "reset_code", None)
    if reset_code is None:  # pragma: no cover - in every PyTorch with torch.compile so far
        return
    for code in codes:
        reset_code(code)


class SuppressedErrors(logging.Filter):
    """The errors dynamo suppresses in one thread during one call, held until the call ends.

    Dynamo runs each frame it gave up on eagerly. At :meth:`settle`, a frame whose eager run
    raised the call's exception failed on the step's own error: its record is dropped (the
    exception says it all) and dynamo may compile it again. The other records are the
    compiler's failures, and are let through then.
    """

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread
        self._held: list[tuple[_Where | None, str, logging.LogRecord]] = []
        self._steps: dict[_Where, CodeType] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.thread != self.thread
            or record.levelno < logging.WARNING
            or not record.exc_info
            or record.exc_info[1] is None
        ):
            return True
        found = _WONT_CONVERT.search(record.getMessage())
        where = (found.group(1), found.group(2), int(found.group(3))) if found else None
        reason = f"dynamo could not compile a frame: {describe(record.exc_info[1])}"
        self._held.append((where, reason, record))
        return False

    def raised_by_step(self, exc: BaseException) -> bool:
        """Whether ``exc`` came out of a frame dynamo gave up on (and ran eagerly)."""
        held = {where for where, _, _ in self._held if where is not None}
        for code in _frames(exc) if held else ():
            where = (code.co_name, code.co_filename, code.co_firstlineno)
            if where in held:
                self._steps[where] = code
        return bool(self._steps)

    def resumed(self) -> tuple[str, str, int] | None:
        """The frame that raised, if it is one dynamo resumes after a graph break (some of
        the call ran compiled before it): its (name, file, first line); else None."""
        for where, code in self._steps.items():
            if code.co_name.startswith(_RESUME_NAMES):
                return where
        return None

    def settle(self, logger: logging.Logger) -> str | None:
        """After the call: let the compiler's records through; the first one's reason, or None."""
        if self._steps:
            recompile(self._steps.values())
        reasons = []
        for where, reason, record in self._held:
            if where not in self._steps:
                logger.handle(record)
                reasons.append(reason)
        return reasons[0] if reasons else None
