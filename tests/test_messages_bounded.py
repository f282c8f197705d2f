"""Every message quotes a user's value through one shortening helper (``_short_repr``).

A megabyte label, lever name or path, or an integer too large for ``repr()`` (Python refuses
past 4300 digits: "Exceeds the limit for integer string conversion"), gives a message of a
few hundred characters that still names the argument, with the value cut and its length
said, never Python's own error about the value.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags
from speedflags import fast_math
from speedflags._short_repr import short_repr, short_str
from speedflags.errors import SpeedflagsError, SpeedflagsWarning

HUGE = "x" * 1_000_000
HUGE_INT = 10**5000
LONGEST = 2_000  # characters: a message with a few values quoted, each at most ~220


def message_of(call: Callable[[], Any]) -> str:
    """What ``call`` raised or warned, as the user reads it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except (SpeedflagsError, ValueError, TypeError, OSError) as exc:
            return str(exc)
    messages = [str(w.message) for w in caught if issubclass(w.category, SpeedflagsWarning)]
    assert messages, "neither raised nor warned"
    return messages[0]


def out_of_order(label: str) -> None:
    outer = fast_math(cudnn_benchmark=True, device="cpu", label=label)
    inner = fast_math(cudnn_benchmark=False, device="cpu", label=label)
    outer.__enter__()
    inner.__enter__()
    try:
        outer.__exit__(None, None, None)  # closes correctly, then raises LedgerOrderError
    finally:
        inner.__exit__(None, None, None)


def exited_twice(label: str) -> None:
    spec = fast_math(cudnn_benchmark=True, device="cpu", label=label)
    with spec:
        pass
    spec.__exit__(None, None, None)


def drift(label: str) -> None:
    with fast_math(cudnn_benchmark=True, device="cpu", label=label):
        torch.backends.cudnn.benchmark = False


def from_another_thread(label: str) -> None:
    frame = speedflags.ledger().open(
        fast_math(cudnn_benchmark=True, device="cpu")._plan().program, label
    )
    errors: list[BaseException] = []

    def close() -> None:
        try:
            speedflags.ledger().close(frame)
        except BaseException as exc:  # the message is what the test reads
            errors.append(exc)

    thread = threading.Thread(target=close)
    thread.start()
    thread.join()
    speedflags.ledger().close(frame)
    raise errors[0]


SCENARIOS = {
    "verify: a megabyte lever name": lambda: speedflags.verify(levers=[HUGE]),
    "verify: an int past repr's limit": lambda: speedflags.verify(levers=HUGE_INT),
    "tune: an int past repr's limit": lambda: speedflags.tune(
        torch.sin, (torch.ones(2),), levers=HUGE_INT
    ),
    "tune: a megabyte lever name": lambda: speedflags.tune(
        torch.sin, (torch.ones(2),), levers={HUGE: [True]}
    ),
    "fast_math: an int past repr's limit": lambda: fast_math(tf32=HUGE_INT),
    "fast_math: a megabyte sdpa backend": lambda: fast_math(sdpa=HUGE),
    "fast_math: a megabyte device": lambda: fast_math(device=HUGE),
    "strict refusal of a megabyte label": lambda: fast_math(
        tf32=True, device="cpu", strict=True, label=HUGE
    ).__enter__(),
    "out-of-order exit of a megabyte label": lambda: out_of_order(HUGE),
    "a block exited twice": lambda: exited_twice(HUGE),
    "drift inside a megabyte label": lambda: drift(HUGE),
    "exit from another thread": lambda: from_another_thread(HUGE),
    "to_device: a megabyte device": lambda: speedflags.training.to_device(torch.ones(1), HUGE),
    "capabilities: a megabyte device": lambda: speedflags.capabilities(HUGE),
    "load_levers: a megabyte path": lambda: speedflags.load_levers(HUGE + ".json"),
    "Schedule: a megabyte lever name": lambda: speedflags.Schedule({0: {HUGE: True}}),
    "check_ranks: an int label": lambda: speedflags.check_ranks(label=HUGE_INT),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_huge_value_gives_a_short_message_naming_it(name: str) -> None:
    # Failed before: verify(levers=[1 MB name]) said it in 1,000,139 characters;
    # levers=10**5000 surfaced "Exceeds the limit for integer string conversion"; a 1 MB
    # label was quoted whole in LedgerOrderError, DriftWarning and the strict refusal.
    message = message_of(SCENARIOS[name])
    length = len(message)
    assert length < LONGEST, f"{length} characters: {message[:300]}"
    assert "Exceeds the limit" not in message, message[:300]


def test_short_repr_and_short_str_say_what_they_cut() -> None:
    assert short_repr(HUGE_INT) == "<int of about 5001 digits>"
    assert short_repr(-(10**300)) == "<int of about 301 digits>"
    assert short_repr(10**100) == repr(10**100)  # short enough: as repr() writes it
    shown = short_repr(HUGE)
    assert len(shown) < 250 and shown.endswith("' (1000000 characters)"), shown
    assert short_str(HUGE).endswith("xxx... (1000000 characters)")
    assert short_str("a short message") == "a short message"
