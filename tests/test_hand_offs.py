"""Python 3.9's signal check points inside the code that hands frames to and from the ledger.

Python 3.9 runs signal handlers between almost any two bytecodes; 3.10 moved the checks to
calls and loop back edges (bpo-29988). On 3.9 a second Ctrl-C landing in ``__enter__``'s
except clause, or in a decorator's ``finally`` before it reached the ledger, left the block's
frame open (CI's floor leg, 1 run in 3 of the 0.2 ms timer test in tests/test_interrupts.py).
``hand_off_after`` marks those instructions critical there: a ``signal_safe`` handler called
at one of them waits until the ledger's close is done. These tests read, at every bytecode
the hand-off functions run (``sys.settrace`` opcode events), what such a handler would do.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any, Callable, List, Tuple

import pytest
import torch

import speedflags
from speedflags import fast_math, speedup
from speedflags.fast_math import FastMath
from speedflags.flag_ledger import decorate
from speedflags.flag_ledger.interrupts import _HAND_OFFS, hand_off_after, in_critical_section

pytestmark = pytest.mark.skipif(
    sys.version_info >= (3, 10),
    reason="Python 3.10+ checks for signals only at calls and loop back edges, which the "
    "ledger's own code covers: hand_off_after marks nothing there",
)


class OpcodeRecorder:
    """A trace function recording, at each bytecode of ``code``, its offset and whether a
    signal_safe handler called there would wait."""

    def __init__(self, code: CodeType) -> None:
        self.code = code
        self.seen: List[Tuple[int, bool]] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not self.code:
            return None
        frame.f_trace_opcodes = True
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.seen.append((frame.f_lasti, in_critical_section(frame)))
        return self.local


def record(code: CodeType, run: Callable[[], Any]) -> List[Tuple[int, bool]]:
    recorder = OpcodeRecorder(code)
    sys.settrace(recorder)
    try:
        run()
    finally:
        sys.settrace(None)
    return recorder.seen


def assert_critical_from(seen: List[Tuple[int, bool]], start: int) -> None:
    assert seen, "the function never ran"
    for offset, critical in seen:
        assert critical == (offset >= start), f"offset {offset} (critical from {start})"


def test_enter_is_critical_from_the_ledgers_open_on_and_in_its_except_clause() -> None:
    code = FastMath.__enter__.__code__
    start = _HAND_OFFS[code]

    def entered() -> None:
        with fast_math(cudnn_benchmark=True, device="cpu"):
            pass

    def refused() -> None:  # the open raises: the except clause runs
        spec = fast_math(cudnn_benchmark=True, device="cpu")

        def fails(self: FastMath, label: str, where: Any) -> Any:
            raise RuntimeError("the open failed")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(FastMath, "_open", fails)
            with pytest.raises(RuntimeError, match="the open failed"), spec:
                pass

    plain = record(code, entered)
    assert_critical_from(plain, start)
    assert any(offset >= start for offset, _ in plain)
    failed = record(code, refused)
    assert_critical_from(failed, start)
    # the except clause ran: more instructions after the call than on the plain path
    assert sum(o >= start for o, _ in failed) > sum(o >= start for o, _ in plain)
    assert not speedflags.ledger().open_frames()


@pytest.mark.parametrize("how", ["fast_math", "speedup"])
def test_a_wrapper_is_critical_after_the_users_function_but_not_while_it_runs(how: str) -> None:
    inside: List[bool] = []

    def body() -> None:
        inside.append(in_critical_section(sys._getframe()))

    wrapped = (
        fast_math(cudnn_benchmark=True, device="cpu")(body)
        if how == "fast_math"
        else speedup(cudnn_benchmark=True, device="cpu")(body)
    )
    code = wrapped.__code__
    seen = record(code, wrapped)
    assert_critical_from(seen, _HAND_OFFS[code])
    assert any(critical for _, critical in seen) and not all(critical for _, critical in seen)
    assert inside == [False]  # the user's own code is interrupted at once


def test_steps_are_critical_from_their_first_open_on() -> None:
    @fast_math(cudnn_benchmark=True, device="cpu")
    def numbers() -> Any:
        yield torch.backends.cudnn.benchmark
        yield torch.backends.cudnn.benchmark

    code = decorate._steps.__code__
    values: List[bool] = []
    seen = record(code, lambda: values.extend(numbers()))
    assert_critical_from(seen, _HAND_OFFS[code])
    assert values == [True, True]  # the levers held at each step
    assert not torch.backends.cudnn.benchmark


def test_hand_off_after_refuses_a_function_that_never_makes_the_call() -> None:
    def no_call() -> int:
        return 1

    with pytest.raises(ValueError, match="never calls 'missing'"):
        hand_off_after("missing")(no_call)
