"""The ledger on its own: its frame API over any lever that follows the protocol.

Each test runs twice: with fake levers over a dict (the ledger knows levers only through
``speedflags.levers._base.Lever``: nothing here needs torch's state), and with torch's own
levers, on a private ``FlagLedger``. Both kits have two process-wide levers on domains of
their own, two levers sharing one domain (as ``tf32`` and ``matmul_precision`` do) and a
thread-local lever (as autocast is).
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import speedflags
from speedflags import DriftWarning, FlagLedger, LedgerOrderError, LeverConflictWarning
from speedflags._ledger.program import Program
from speedflags._ledger.scope import FrameScope
from speedflags.errors import InvalidValueError, MixedTF32APIError
from speedflags.levers._base import Lever, Scope
from speedflags.levers.registry import lever_spec


class FakeLever:
    """A lever over one key of a dict (per thread for ``scope="thread"``): the whole
    :class:`~speedflags.levers._base.Lever` protocol, and nothing of torch.

    A state of ``"mixed"`` is refused by ``check`` (as the TF32 family refuses a mixed
    state); ``fail`` makes the next ``apply`` raise.
    """

    checks_state = True

    def __init__(
        self, store: dict[Hashable, Any], name: str, domain: str = "", scope: Scope = "process"
    ) -> None:
        self.store = store
        self.name = name
        self.domain = domain or name
        self.scope = scope
        self.fail = False

    def _key(self) -> Hashable:
        return (self.domain, threading.get_ident()) if self.scope == "thread" else self.domain

    def read(self) -> Hashable:
        return self.store.get(self._key(), 0)  # type: ignore[no-any-return]

    def check(self, state: Any) -> None:
        if state == "mixed":
            raise InvalidValueError(f"{self.name}: refuses to start from a mixed state")

    def apply(self, value: Any, before: Any) -> Hashable:
        if self.fail:
            self.fail = False
            raise RuntimeError(f"{self.name}: apply failed")
        self.store[self._key()] = value
        return self.read()

    def restore(self, target: Any, current: Any) -> Hashable:
        self.store[self._key()] = target
        return self.read()

    def describe(self, state: Any) -> Any:
        return state

    def describe_value(self, value: Any) -> Any:
        return value


@dataclass
class Kit:
    """Levers for the tests and how to drive them: ``a`` and ``b`` (own domains), ``x`` and
    ``y`` (one domain), ``t`` (thread-local), two values each, not their state at the start."""

    kind: str
    a: Lever
    b: Lever
    x: Lever
    y: Lever
    t: Lever
    values: dict[str, tuple[Any, Any]]
    poke: Callable[[Lever, Any], None]  # a write made outside the ledger
    fail: Callable[[Lever], None]  # the next apply of this lever raises
    mix: Callable[[], Any]  # puts x's domain in a state its check refuses; returns an undo

    def state(self) -> tuple[Any, ...]:
        return tuple(lever.read() for lever in (self.a, self.b, self.x, self.t))


def fake_kit() -> Kit:
    store: dict[Hashable, Any] = {}
    a, b = FakeLever(store, "a"), FakeLever(store, "b")
    x, y = FakeLever(store, "x", "shared"), FakeLever(store, "y", "shared")
    t = FakeLever(store, "t", scope="thread")

    def fail(lever: Lever) -> None:
        lever.fail = True  # type: ignore[attr-defined]

    def mix() -> Callable[[], None]:
        store["shared"] = "mixed"
        return lambda: store.pop("shared")

    values = {"a": (1, 2), "b": (10, 20), "x": (5, 6), "y": (7, 8), "t": (3, 4)}
    return Kit("fake", a, b, x, y, t, values, lambda lever, v: lever.apply(v, lever.read()),
               fail, mix)  # fmt: skip


def torch_kit(monkeypatch: pytest.MonkeyPatch) -> Kit:
    def lever(name: str, device_type: str = "cpu") -> Lever:
        return lever_spec(name).lever(device_type)

    def value(name: str, raw: Any) -> Any:
        return lever_spec(name).check("test", raw)

    def fail(target: Lever) -> None:
        real = target.apply

        def failing(value: Any, before: Any) -> Any:
            monkeypatch.setattr(target, "apply", real)
            raise RuntimeError(f"{target.name}: apply failed")

        monkeypatch.setattr(target, "apply", failing)

    def mix() -> Callable[[], None]:
        if speedflags.tf32_status().api == "legacy":
            pytest.skip(f"PyTorch {torch.__version__} has one TF32 API: no mixed state")
        matmul = torch.backends.cuda.matmul
        was = matmul.fp32_precision
        matmul.fp32_precision = "tf32"  # the new API only: the two APIs disagree
        return lambda: setattr(matmul, "fp32_precision", was)

    values = {
        "a": (True, False),  # cudnn_benchmark: False at the start, so the first value changes it
        "b": (value("sdpa", ("math",)), value("sdpa", ("flash", "math"))),
        "x": ("high", "medium"),  # matmul_precision and tf32 share the fp32 family
        "y": (True, False),
        "t": (torch.bfloat16, None),  # amp on cpu: bf16, then off
    }
    return Kit(
        "torch", lever("cudnn_benchmark"), lever("sdpa"), lever("matmul_precision"),
        lever("tf32"), lever("amp"), values, lambda it, v: it.apply(v, it.read()), fail, mix,
    )  # fmt: skip


@pytest.fixture(params=["fake", "torch"])
def kit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kit]:
    made = fake_kit() if request.param == "fake" else torch_kit(monkeypatch)
    start = made.state()
    yield made
    assert made.state() == start  # every test leaves the levers as it found them


def v(kit: Kit, name: str, which: int = 0) -> Any:
    return kit.values[name][which]


# --- the protocol --------------------------------------------------------------------------


def test_both_kits_follow_the_lever_protocol(kit: Kit) -> None:
    for lever in (kit.a, kit.b, kit.x, kit.y, kit.t):
        assert isinstance(lever, Lever)
    assert kit.t.scope == "thread" and kit.x.domain == kit.y.domain != kit.a.domain


# --- open and close ------------------------------------------------------------------------


def test_open_applies_and_close_restores_with_a_record_each(kit: Kit) -> None:
    ledger = FlagLedger()
    before = kit.state()
    frame = ledger.open([(kit.a, v(kit, "a")), (kit.t, v(kit, "t"))], label="both")
    assert frame.levers == (kit.a.name, kit.t.name) and not frame.closed
    assert kit.a.read() != before[0] and kit.t.read() != before[3]
    assert ledger.open_frames() == (frame,)
    frame.close()
    assert kit.state() == before and frame.closed and ledger.open_frames() == ()
    assert [(r.lever, r.action, r.label) for r in ledger.history] == [
        (kit.a.name, "set", "both"),
        (kit.t.name, "set", "both"),
        (kit.t.name, "restore", "both"),
        (kit.a.name, "restore", "both"),
    ]
    with pytest.raises(LedgerOrderError, match="already closed"):
        frame.close()


def test_nested_frames_restore_what_each_found(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.a.read()
    outer = ledger.open([(kit.a, v(kit, "a", 0))], label="outer")
    inside_outer = kit.a.read()
    inner = ledger.open([(kit.a, v(kit, "a", 1))], label="inner")
    assert kit.a.read() != inside_outer
    inner.close()
    assert kit.a.read() == inside_outer
    outer.close()
    assert kit.a.read() == base


def test_two_levers_of_one_domain_hand_over_their_state(kit: Kit) -> None:
    ledger = FlagLedger()
    before = kit.x.read()
    frame = ledger.open([(kit.x, v(kit, "x")), (kit.y, v(kit, "y"))])
    program = frame.program
    assert program.prev == (-1, 0)  # y starts from the state x left
    assert frame.befores[1] == frame.afters[0]
    frame.close()
    assert kit.x.read() == before


def test_an_out_of_order_exit_is_refused_after_restoring_and_the_later_frame_keeps_its_own(
    kit: Kit,
) -> None:
    ledger = FlagLedger()
    base = kit.state()
    outer = ledger.open([(kit.a, v(kit, "a", 0)), (kit.b, v(kit, "b", 0))], label="outer")
    inner = ledger.open([(kit.a, v(kit, "a", 1))], label="inner")
    held = kit.a.read()
    with pytest.raises(LedgerOrderError, match="'inner'"):
        outer.close()
    assert outer.closed and kit.a.read() == held  # inner keeps its value
    assert kit.b.read() == base[1]  # outer's other lever is restored
    inner.close()
    assert kit.state() == base


def test_a_failing_apply_rolls_the_frame_back(kit: Kit) -> None:
    ledger = FlagLedger()
    before = kit.state()
    kit.fail(kit.b)
    with pytest.raises(RuntimeError, match="apply failed"):
        ledger.open([(kit.a, v(kit, "a")), (kit.b, v(kit, "b")), (kit.t, v(kit, "t"))])
    assert kit.state() == before and ledger.open_frames() == ()
    rolled = [r for r in ledger.history if r.action == "restore"]
    # b failed while being applied (its restore writes nothing), a is rolled back, t untouched
    assert [r.lever for r in rolled] == [kit.b.name, kit.a.name]
    assert rolled[0].reason.startswith("rolled back")


def test_a_refused_state_changes_nothing(kit: Kit) -> None:
    ledger = FlagLedger()
    undo = kit.mix()
    try:
        before = kit.state()
        with pytest.raises((InvalidValueError, MixedTF32APIError)):
            ledger.open([(kit.a, v(kit, "a")), (kit.x, v(kit, "x"))])
        assert kit.state() == before and ledger.open_frames() == ()
        assert ledger.history == ()
    finally:
        undo()


def test_a_program_checks_every_new_state_and_refuses_a_mixed_one_each_time(kit: Kit) -> None:
    # open() passes a state equal to the last one it checked on unchecked (the hot path):
    # a state it refused is never that one, however often it is met
    ledger = FlagLedger()
    program = Program.of([(kit.x, v(kit, "x"))])
    ledger.open(program).close()  # the state at the start: checked, passed
    undo = kit.mix()
    try:
        before = kit.state()
        for _ in range(2):
            with pytest.raises((InvalidValueError, MixedTF32APIError)):
                ledger.open(program)
            assert kit.state() == before and ledger.open_frames() == ()
    finally:
        undo()
    ledger.open(program).close()  # consistent again: entered
    assert [r.action for r in ledger.history] == ["set", "restore"] * 2


def test_drift_inside_a_frame_is_restored_with_a_warning(kit: Kit) -> None:
    ledger = FlagLedger()
    before = kit.a.read()
    frame = ledger.open([(kit.a, v(kit, "a", 0))], label="drifting")
    kit.poke(kit.a, v(kit, "a", 1))  # code inside the block changes the lever
    with pytest.warns(DriftWarning, match=f"{kit.a.name} was changed inside 'drifting'"):
        frame.close()
    assert kit.a.read() == before
    assert ledger.history[-1].reason.startswith("drift")


# --- threads -------------------------------------------------------------------------------


def in_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join(30)
    return out[0]


def test_a_thread_local_lever_is_invisible_to_other_threads(kit: Kit) -> None:
    ledger = FlagLedger()
    elsewhere = in_thread(kit.t.read)
    with ledger.frame([(kit.t, v(kit, "t"))]):
        assert in_thread(kit.t.read) == elsewhere != kit.t.read()


def test_a_frame_closed_under_another_threads_frame_re_applies_it(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.a.read()
    mine = ledger.open([(kit.a, v(kit, "a", 0))], label="mine")
    entered, release = threading.Event(), threading.Event()
    seen: list[Any] = []

    def theirs() -> None:
        frame = ledger.open([(kit.a, v(kit, "a", 1))], label="theirs")
        seen.append(kit.a.read())
        entered.set()
        release.wait(30)
        seen.append(kit.a.read())
        frame.close()

    worker = threading.Thread(target=theirs)
    with pytest.warns(LeverConflictWarning, match="'theirs'"):
        worker.start()
        entered.wait(30)
    mine.close()  # under theirs: restores what mine found, then re-applies theirs
    release.set()
    worker.join(30)
    assert seen[0] == seen[1]  # theirs kept its value while mine exited
    assert kit.a.read() == base
    assert any(r.reason.startswith("re-applied") for r in ledger.history)


# --- the context form: with, async with, start/stop, a decorator ---------------------------


def test_a_scope_is_reusable_and_reentrant(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.state()
    scope = ledger.frame([(kit.a, v(kit, "a")), (kit.t, v(kit, "t"))], label="scope")
    assert isinstance(scope, FrameScope) and scope.ledger is ledger
    with scope as outer:
        inside = kit.state()
        with scope as inner:
            assert kit.state() == inside and inner is not outer
        assert not outer.closed and inner.closed
    assert kit.state() == base and outer.closed
    with pytest.raises(LedgerOrderError, match="exited again"):
        scope.__exit__(None, None, None)
    with pytest.raises(LedgerOrderError, match="no open frame"):
        ledger.frame([(kit.a, v(kit, "a"))]).__exit__(None, None, None)


def test_start_and_stop_hold_a_frame_across_calls(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.state()
    scope = ledger.frame([(kit.a, v(kit, "a"))], label="held")
    frame = scope.start()
    assert frame.where.endswith(f":{frame_line(test_start_and_stop_hold_a_frame_across_calls)}")
    assert kit.a.read() != base[0]
    scope.stop()
    assert kit.state() == base and frame.closed
    scope.stop()  # nothing open: nothing to do (as unittest.mock's patch.stop())


def frame_line(test: Callable[..., Any]) -> int:
    import inspect

    source, first = inspect.getsourcelines(test)
    return first + next(i for i, line in enumerate(source) if "scope.start()" in line)


def test_a_decorated_function_gets_a_frame_per_call_and_a_generator_per_step(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.a.read()
    scope = ledger.frame([(kit.a, v(kit, "a"))], label="deco")

    @scope
    def call() -> Any:
        return kit.a.read()

    @scope
    def steps() -> Iterator[Any]:
        yield kit.a.read()
        yield kit.a.read()

    inside = call()
    assert inside != base and kit.a.read() == base
    it = steps()
    assert next(it) == inside and kit.a.read() == base  # restored while suspended
    assert next(it) == inside
    it.close()
    assert ledger.history[-1].label.endswith(": deco")
    assert ledger.open_frames() == ()


def test_async_with_opens_the_frame_in_the_running_task(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.a.read()
    scope = ledger.frame([(kit.a, v(kit, "a"))])

    async def task() -> Any:
        async with scope as frame:
            assert frame.task is asyncio.current_task()
            return kit.a.read()

    assert asyncio.run(task()) != base
    assert kit.a.read() == base


def test_an_exception_inside_a_block_restores_and_propagates(kit: Kit) -> None:
    ledger = FlagLedger()
    base = kit.state()
    with pytest.raises(KeyboardInterrupt):
        with ledger.frame([(kit.a, v(kit, "a")), (kit.t, v(kit, "t"))]):
            raise KeyboardInterrupt
    assert kit.state() == base and ledger.open_frames() == ()


def test_bad_items_are_refused_naming_what_was_given() -> None:
    with pytest.raises(speedflags.InvalidTypeError, match=r"expected \(lever, value\) or"):
        FlagLedger().open(["cudnn_benchmark"])  # type: ignore[list-item]


@pytest.mark.parametrize("form", ["frame", "open"])
def test_a_non_lever_is_refused_naming_it_before_anything_changes(kit: Kit, form: str) -> None:
    # Failed before: ledger.frame([("cudnn_benchmark", True)]) and ledger.open(...) with a
    # string or object() as the lever died with "AttributeError: 'str' object has no
    # attribute 'name'" from deep inside.
    ledger = FlagLedger()
    base = kit.state()

    class HalfLever:  # a lever but for its scope (describe_value has a default)
        name = domain = "half"
        scope = "global"
        checks_state = False

        def read(self) -> int:
            return 0

        check = apply = restore = describe = read

    for given, shown in [
        ("cudnn_benchmark", "'cudnn_benchmark' is not a lever: it has no name, read, apply; "),
        (object(), "<object object at 0x"),
        (HalfLever(), "is not a lever: it lacks a scope the ledger keeps"),
    ]:  # fmt: skip
        levers = [(kit.a, v(kit, "a")), (given, True)]
        with pytest.raises(speedflags.InvalidTypeError) as refused:
            if form == "frame":
                ledger.frame(levers)  # type: ignore[list-item]
            else:
                ledger.open(levers)  # type: ignore[list-item]
        assert str(refused.value).startswith("levers: ") and shown in str(refused.value)
        assert not isinstance(refused.value, AttributeError)
    assert str(refused.value).endswith("('process' or 'thread', not 'global')")
    assert kit.state() == base and ledger.open_frames() == () and ledger.history == ()


def test_the_process_ledger_is_untouched_by_a_private_one(kit: Kit) -> None:
    def last_seq() -> list[int]:
        return [r.seq for r in speedflags.ledger().history[-1:]]

    seen = last_seq()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        private = FlagLedger()
        with private.frame([(kit.a, v(kit, "a"))]):
            pass
    assert last_seq() == seen and len(private.history) == 2
