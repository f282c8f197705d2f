"""Schedule and TF32Schedule: switch at the right epochs, record each switch, restore."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from conftest import autocast_enabled

import speedflags
from speedflags import InvalidTypeError, InvalidValueError, Schedule, TF32Schedule


def switches() -> list[Any]:
    return [r for r in speedflags.ledger().history if r.lever == "schedule"]


def tf32_on() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


def test_tf32_schedule_switches_at_the_right_epochs_and_restores() -> None:
    before = speedflags.snapshot()
    sched = TF32Schedule({0: True, 100: False})
    seen = {}
    for epoch in range(0, 130):
        sched.step(epoch)
        seen[epoch] = tf32_on()
    assert all(seen[e] for e in range(100)) and not any(seen[e] for e in range(100, 130))
    assert sched.active == 100
    sched.close()
    assert speedflags.snapshot() == before
    assert sched.active is None


def test_each_switch_is_recorded_once() -> None:
    start = len(switches())
    with TF32Schedule({0: True, 3: False}) as sched:
        for epoch in range(6):
            sched.step(epoch)
    recorded = switches()[start:]
    assert [(r.action, r.before, r.after) for r in recorded] == [
        ("switch", {}, {"tf32": True}),
        ("switch", {"tf32": True}, {"tf32": False}),
    ]
    assert recorded[1].reason == "epoch 3: settings of epoch 3"
    assert recorded[0].where.split(":")[0].endswith("test_schedule.py")
    tf32_records = [r for r in speedflags.ledger().history[-12:] if r.lever == "tf32"]
    assert [r.action for r in tf32_records][-4:] == ["set", "restore", "set", "restore"]


def test_several_levers_and_an_empty_entry() -> None:
    before = speedflags.snapshot()
    sched = Schedule(
        {
            0: dict(matmul_precision="high", amp="bf16"),
            2: dict(cudnn_benchmark=True),
            4: {},
        },
        device="cpu",
    )
    states = []
    for epoch in range(5):
        assert sched.step(epoch) == sched.settings_at(epoch)
        states.append(
            (
                torch.get_float32_matmul_precision(),
                autocast_enabled("cpu"),
                torch.backends.cudnn.benchmark,
            )
        )
    assert states == [
        ("high", True, False),
        ("high", True, False),
        ("highest", False, True),
        ("highest", False, True),
        ("highest", False, False),
    ]
    sched.close()
    assert speedflags.snapshot() == before


def test_before_the_first_epoch_nothing_is_applied() -> None:
    with TF32Schedule({5: True}) as sched:
        assert sched.step(0) == {}
        assert not tf32_on()
        sched.step(5)
        assert tf32_on()
    assert not tf32_on()


def test_close_twice_and_step_after_close() -> None:
    sched = TF32Schedule({0: True})
    sched.step(0)
    sched.close()
    sched.close()
    assert not tf32_on()
    sched.step(1)  # reopens
    assert tf32_on()
    sched.close()
    assert not tf32_on()


def test_amp_from_a_schedule_is_thread_local() -> None:
    seen: list[bool] = []
    with Schedule({0: dict(amp="bf16")}, device="cpu") as sched:
        sched.step(0)
        other = threading.Thread(target=lambda: seen.append(autocast_enabled("cpu")))
        other.start()
        other.join(30)
        assert autocast_enabled("cpu")
    assert seen == [False]
    assert not autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("schedule", "error", "message"),
    [
        ({-1: dict(tf32=True)}, InvalidValueError, "Schedule: epoch -1: expected a non-negative"),
        ({1.5: dict(tf32=True)}, InvalidTypeError, "Schedule: epoch 1.5: expected a non-negative"),
        ({True: dict(tf32=True)}, InvalidTypeError, "Schedule: epoch True: expected"),
        ({"0": dict(tf32=True)}, InvalidTypeError, "Schedule: epoch '0': expected"),
        (
            {0: dict(tf33=True)},
            InvalidValueError,
            "Schedule: epoch 0: unknown lever 'tf33'; valid: amp, cudnn_benchmark, "
            "deterministic, fp8, matmul_precision, memory_format, param_dtype, "
            "reduced_precision_reduction, sdpa, tf32",
        ),
        ({0: dict(amp="bf17")}, InvalidValueError, "Schedule: epoch 0: fast_math(amp='bf17'): "),
        ({0: True}, InvalidTypeError, "Schedule: epoch 0: expected a dict of fast_math"),
        ({}, InvalidValueError, "Schedule({}): needs at least one epoch"),
        ([(0, {})], InvalidTypeError, "Schedule([(0, {})]): expected a dict"),
    ],
)
def test_bad_schedules_fail_at_construction(schedule: Any, error: type, message: str) -> None:
    before = speedflags.snapshot()
    with pytest.raises(error) as excinfo:
        Schedule(schedule)
    assert str(excinfo.value).startswith(message)
    assert speedflags.snapshot() == before


def test_bad_tf32_schedules() -> None:
    with pytest.raises(InvalidTypeError, match=r"^TF32Schedule: epoch 100: expected True or False"):
        TF32Schedule({0: True, 100: "off"})  # type: ignore[dict-item]
    with pytest.raises(InvalidValueError, match=r"^TF32Schedule: epoch -3"):
        TF32Schedule({-3: True})


def test_step_refuses_a_bad_epoch() -> None:
    sched = TF32Schedule({0: True})
    with pytest.raises(InvalidValueError, match=r"^TF32Schedule.step: epoch -1"):
        sched.step(-1)
    assert not tf32_on()


@pytest.mark.parametrize("schedule", [{0: {}}, {0: {}, 10: {}}], ids=["one", "two"])
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(device=object()), InvalidTypeError, "Schedule(device=<object object at "),
        (dict(device="gpu"), InvalidValueError, "Schedule(device='gpu'): not a device"),
        (dict(strict="x"), InvalidTypeError, "Schedule(strict='x'): expected True or False"),
    ],
)
def test_device_and_strict_are_checked_even_when_every_entry_is_empty(
    schedule: Any, kwargs: Any, error: type, message: str
) -> None:
    # an empty entry builds no fast_math, which used to be the only place they were checked
    with pytest.raises(error) as excinfo:
        Schedule(schedule, **kwargs)
    assert str(excinfo.value).startswith(message)


def test_a_switch_interrupted_at_any_line_is_made_again_by_the_next_step() -> None:
    # Ctrl-C during step(): KeyboardInterrupt injected at every line of step and _close in
    # turn (sys.settrace). The next steps must apply their epochs' settings (not believe
    # they hold), no frame may be left open, and close() must leave every flag as before.
    from test_interrupts import Injector, statement_lines

    before = speedflags.snapshot()
    targets = (Schedule.step, Schedule._close)
    fired = 0
    for target in targets:
        for line in statement_lines(target):
            schedule = Schedule(
                {0: {"cudnn_benchmark": True}, 2: {"matmul_precision": "high"}}, device="cpu"
            )
            schedule.step(0)
            injector = Injector(target.__code__, line, 1, KeyboardInterrupt)
            sys.settrace(injector)
            try:
                schedule.step(2)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            fired += injector.fired
            where = f"{target.__name__} line {line}"
            # back to the epoch it was leaving: its settings must be applied again
            assert schedule.step(1) == {"cudnn_benchmark": True}, where
            assert torch.backends.cudnn.benchmark, where
            assert len(speedflags.ledger().open_frames()) == 1, where
            assert schedule.step(2) == {"matmul_precision": "high"}, where
            assert torch.get_float32_matmul_precision() == "high", where
            assert not torch.backends.cudnn.benchmark, where
            assert schedule.active == 2, where
            assert len(speedflags.ledger().open_frames()) == 1, where
            schedule.close()
            assert not speedflags.ledger().open_frames(), where
            assert speedflags.snapshot() == before, where
    assert fired >= 10  # the injections really landed


def test_a_close_that_raised_leaves_the_schedule_holding_nothing() -> None:
    # close() under a block entered after the schedule's settings: the ledger restores, then
    # raises LedgerOrderError. The schedule holds nothing then: the next step(0) must apply
    # epoch 0 again, not report settings that do not hold (it returned them, with
    # cudnn.benchmark False, before).
    sched = Schedule({0: {"cudnn_benchmark": True}})
    inner = speedflags.fast_math(matmul_precision="high", label="inner")
    sched.step(0)
    inner.start()
    with pytest.raises(speedflags.LedgerOrderError, match="exited while 'inner'"):
        sched.close()
    assert sched.active is None
    inner.stop()
    assert not torch.backends.cudnn.benchmark
    assert sched.step(0) == {"cudnn_benchmark": True}
    assert sched.active == 0 and torch.backends.cudnn.benchmark
    sched.close()
    assert not torch.backends.cudnn.benchmark
    assert speedflags.ledger().open_frames() == ()
