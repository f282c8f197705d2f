"""A lever written outside speedflags, as a library would write one: a process-wide setting
kept in a dict (it could be an inductor config value, a thread count, a global of the
library's own), following the Lever protocol of docs/ledger.md plus ``validate``."""

from __future__ import annotations

from typing import Any

SETTINGS: dict[str, int] = {"workers": 1}


class WorkersLever:
    """``fast_math(workers=N)``: the library's worker count, 1 to 64."""

    name = "workers"
    domain = "my_library.workers"
    scope = "process"
    checks_state = False
    summary = "my_library's worker count"
    accuracy = "none"
    values = "an int from 1 to 64"
    baseline = 1
    candidates = (4, 8)

    def validate(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an int, got {type(value).__name__}")
        if not 1 <= value <= 64:
            raise ValueError("expected 1 to 64 workers")
        return value

    def read(self) -> int:
        return SETTINGS["workers"]

    def check(self, state: Any) -> None:
        return None

    def apply(self, value: int, before: int) -> int:
        SETTINGS["workers"] = value
        return value

    def restore(self, target: int, current: int) -> int:
        SETTINGS["workers"] = target
        return target

    def describe(self, state: int) -> int:
        return state

    def describe_value(self, value: int) -> int:
        return value
