"""The ledger: history records, order errors, drift, threads, bounded memory, JSON."""

from __future__ import annotations

import json
import random
import threading
import warnings
from typing import Any

import pytest
import torch
from conftest import autocast_enabled

import speedflags
from speedflags import (
    DriftWarning,
    FlagLedger,
    LedgerOrderError,
    LeverConflictWarning,
    fast_math,
)
from speedflags._ledger.own_writes import OWN_WRITES
from speedflags._ledger.program import Program
from speedflags.levers import PROCESS_LEVERS

THIS_FILE = __file__


# --- behaviour 10: a set and a restore record per lever, with before/after and file:line --


def test_history_has_a_set_and_a_restore_record_per_lever(fresh_history: None) -> None:
    before = speedflags.snapshot()
    with fast_math(tf32=True, cudnn_benchmark=True, amp="bf16", device="cpu"):
        inside = speedflags.snapshot()
    # (the frame's own records: a watch running, the suite's leak plugin, notes at the
    # block's boundary what earlier tests' raw torch calls changed, as "external")
    records = [r for r in speedflags.ledger().history if r.action != "external"]
    assert [(r.lever, r.action) for r in records] == [
        ("tf32", "set"),
        ("cudnn_benchmark", "set"),
        ("amp", "set"),
        ("amp", "restore"),
        ("cudnn_benchmark", "restore"),
        ("tf32", "restore"),
    ]
    sets = {r.lever: r for r in records if r.action == "set"}
    restores = {r.lever: r for r in records if r.action == "restore"}
    assert sets["tf32"].before == before["tf32"]
    assert sets["tf32"].after == inside["tf32"]
    assert sets["cudnn_benchmark"].before is False
    assert sets["cudnn_benchmark"].after is True
    assert sets["amp"].after == {"enabled": True, "dtype": "bfloat16"}
    assert restores["tf32"].before == inside["tf32"]
    assert restores["tf32"].after == before["tf32"]
    assert restores["amp"].after == before["amp"]["cpu"]
    for record in records:
        filename, _, line = record.where.rpartition(":")
        assert filename == THIS_FILE and line.isdigit()
        assert (
            record.label == "fast_math(tf32=True, cudnn_benchmark=True, amp='bf16', device='cpu')"
        )
        assert record.thread == threading.current_thread().name
    assert len({r.frame for r in records}) == 1
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    assert "no effect on cpu" in sets["tf32"].reason


def test_to_json_is_valid_and_carries_versions(fresh_history: None) -> None:
    with fast_math(tf32=True, label="json-test"):
        pass
    payload = json.loads(speedflags.ledger().to_json())
    assert payload["torch"] == torch.__version__
    assert payload["speedflags"] == speedflags.__version__
    assert [r["action"] for r in payload["records"]] == ["set", "restore"]
    assert payload["records"][0]["label"] == "json-test"
    assert payload["records"][0]["after"]["torch.backends.cuda.matmul.allow_tf32"] is True


def test_history_is_bounded() -> None:
    small = FlagLedger(history_size=10)
    program = Program([(PROCESS_LEVERS["cudnn_benchmark"], True, "")])
    for _ in range(100):
        small.close(small.open(program, "loop"))
    history = small.history
    # the 10 most recent of the 200 records (a set and a restore per frame), in order
    assert [r.seq for r in history] == list(range(191, 201))
    assert [r.action for r in history] == ["set", "restore"] * 5
    assert json.loads(small.to_json())["records"][0]["seq"] == 191


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"before": {(0, 1): "on"}}, r"note\(before=\{\(0, 1\): 'on'\}\): not exportable: keys "),
        ({"after": {"x": {1: {(2,): 3}}}}, r"note\(after=.*\): not exportable: keys must be str"),
        ({"after": "cycle"}, r"note\(after=\[\[.*\): not exportable: Circular reference"),
        ({"action": 3}, r"note\(action=3\): expected a str, got int"),
        ({"label": None}, r"note\(label=None\): expected a str, got NoneType"),
    ],
)
def test_a_note_to_json_cannot_write_is_refused_and_nothing_is_recorded(
    given: dict[str, Any], message: str
) -> None:
    # Failed before: note(..., before={(0, 1): "on"}) was accepted, and every later to_json()
    # raised "TypeError: keys must be str" until clear_history().
    ledger = FlagLedger()
    ledger.note("tf32", "heal", "before the refused one", before={"a": [1, 2.5, None]})
    if given.get("after") == "cycle":
        cycle: list[Any] = []
        cycle.append(cycle)
        given = {"after": cycle}
    kwargs: dict[str, Any] = {"action": "note", **given}
    action = kwargs.pop("action")
    with pytest.raises(speedflags.InvalidTypeError, match=message):
        ledger.note("x", action, "r", **kwargs)
    records = json.loads(ledger.to_json())["records"]
    assert [r["reason"] for r in records] == ["before the refused one"]
    assert records[0]["before"] == {"a": [1, 2.5, None]}
    ledger.note("x", "note", "sets export too", before=frozenset({"b", "a"}))
    assert json.loads(ledger.to_json())["records"][-1]["before"] == ["a", "b"]


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_history_size_must_be_a_positive_int(size: Any) -> None:
    with pytest.raises(ValueError, match="history_size"):
        FlagLedger(history_size=size)


# --- behaviour 9: out-of-order exits and drift ----------------------------------------------


def test_out_of_order_exit_names_both_frames_and_keeps_the_state_right() -> None:
    outer = fast_math(cudnn_benchmark=True, label="outer")
    inner = fast_math(cudnn_benchmark=False, tf32=True, label="inner")
    base = speedflags.snapshot()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(LedgerOrderError) as excinfo:
        outer.__exit__(None, None, None)
    message = str(excinfo.value)
    assert "'outer'" in message and "'inner'" in message
    assert isinstance(excinfo.value, speedflags.SpeedflagsError)
    # inner is still open and keeps what it asked for
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cuda.matmul.allow_tf32 is True
    inner.__exit__(None, None, None)
    assert speedflags.snapshot() == base


def test_exit_twice_or_without_enter_is_an_error() -> None:
    spec = fast_math(cudnn_benchmark=True)
    with pytest.raises(LedgerOrderError, match="not entered"):
        spec.__exit__(None, None, None)
    frame = speedflags.ledger().open(Program([]), "manual")
    speedflags.ledger().close(frame)
    with pytest.raises(LedgerOrderError, match="already closed"):
        speedflags.ledger().close(frame)


def test_drift_is_restored_with_one_warning_per_cause() -> None:
    base = torch.backends.cudnn.benchmark
    spec = fast_math(cudnn_benchmark=True, label="drifting")
    with pytest.warns(DriftWarning) as caught:
        for _ in range(3):
            with spec:
                torch.backends.cudnn.benchmark = False  # code inside the block changes it
    assert torch.backends.cudnn.benchmark is base
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "cudnn_benchmark" in message
    assert "found False" in message
    assert "restoring False" in message
    assert "'drifting'" in message
    record = speedflags.ledger().history[-1]
    assert record.action == "restore" and record.reason.startswith("drift")


def test_drift_of_tf32_inside_a_block_is_restored_exactly() -> None:
    before = speedflags.snapshot()
    with pytest.warns(DriftWarning, match="tf32"), fast_math(tf32=True):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("medium")
    assert speedflags.snapshot() == before


# --- behaviour 11: threads --------------------------------------------------------------------


def test_process_wide_levers_stack_across_threads_that_exit_in_any_order() -> None:
    base = torch.backends.cudnn.benchmark
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []
    errors: list[BaseException] = []

    def thread_a() -> None:
        try:
            with fast_math(cudnn_benchmark=True, label="A"):
                a_entered.set()
                b_entered.wait(10)
            a_exited.set()
        except BaseException as exc:
            errors.append(exc)

    def thread_b() -> None:
        try:
            a_entered.wait(10)
            with fast_math(cudnn_benchmark=False, label="B"):
                b_entered.set()
                a_exited.wait(10)
                seen.append(torch.backends.cudnn.benchmark)  # A exited first: B's value holds
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    with pytest.warns(LeverConflictWarning, match="'A'"):  # B overrides A's open block
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert not errors
    assert seen == [False]
    assert torch.backends.cudnn.benchmark is base
    reapplied = [r for r in speedflags.ledger().history if r.reason.startswith("re-applied")]
    assert reapplied and reapplied[-1].label == "B"


def test_autocast_is_thread_local() -> None:
    seen: list[bool] = []
    with fast_math(amp="bf16", device="cpu"):
        worker = threading.Thread(target=lambda: seen.append(autocast_enabled("cpu")))
        worker.start()
        worker.join(30)
        assert autocast_enabled("cpu")
    assert seen == [False]


def test_exit_from_another_thread_is_refused_and_changes_nothing() -> None:
    spec = fast_math(cudnn_benchmark=True)
    frame = spec.__enter__()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            speedflags.ledger().close(frame)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join(30)
    assert len(errors) == 1 and isinstance(errors[0], LedgerOrderError)
    assert torch.backends.cudnn.benchmark is True  # untouched: still open
    spec.__exit__(None, None, None)


def test_stop_exit_and_close_from_another_thread_are_refused_alike() -> None:
    # Failed before: scope.stop() from another thread did nothing (the frame stayed open, the
    # flag set, no error), while __exit__ there raised. Now every way out refuses the same
    # way, restores nothing, and the frame stays open for its own thread.
    spec = fast_math(cudnn_benchmark=True, label="held by main")
    frame = spec.start()
    errors: list[str] = []

    def other() -> None:
        for leave in (spec.stop, lambda: spec.__exit__(None, None, None), frame.close):
            try:
                leave()
            except LedgerOrderError as exc:
                errors.append(str(exc))
        spec_here = fast_math(tf32=True)
        spec_here.stop()  # never started anywhere: nothing to do, as before

    worker = threading.Thread(target=other, name="other")
    worker.start()
    worker.join(30)
    assert len(errors) == 3 and len(set(errors)) == 1, errors
    assert errors[0].startswith(
        "frame 'held by main' was entered in thread 'MainThread' and cannot be exited from "
        "thread 'other'; nothing was restored. It stays open for thread 'MainThread' to exit"
    )
    assert torch.backends.cudnn.benchmark is True and not frame.closed
    spec.stop()
    assert torch.backends.cudnn.benchmark is False and frame.closed


def test_many_threads_entering_and_exiting_leave_the_base_state() -> None:
    before = speedflags.snapshot()
    specs = [
        fast_math(cudnn_benchmark=True),
        fast_math(cudnn_benchmark=False, sdpa="math"),
        fast_math(tf32=True, amp="bf16", device="cpu"),
        fast_math(matmul_precision="medium"),
        fast_math(tf32=False, sdpa=("flash", "math")),
    ]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                with rng.choice(specs):
                    if rng.random() < 0.5:
                        with rng.choice(specs):
                            pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    # whether blocks of different threads overlap (and warn of the conflict) is up to timing
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always", LeverConflictWarning)
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    assert speedflags.snapshot() == before
    assert speedflags.ledger().open_frames() == ()


# --- OWN_WRITES: the ledger's own writes can be told from external ones ---------------------


def test_own_writes_marks_the_ledgers_writes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    real = torch._C._set_cudnn_benchmark

    def watched(value: bool) -> None:  # what a watcher wrapping the setter sees
        seen.append((value, OWN_WRITES.depth))
        real(value)

    monkeypatch.setattr(torch._C, "_set_cudnn_benchmark", watched)
    base = torch.backends.cudnn.benchmark
    with fast_math(cudnn_benchmark=not base):
        assert OWN_WRITES.depth == 0  # only while the ledger writes
    torch._C._set_cudnn_benchmark(base)  # an external write
    assert seen == [(not base, 1), (base, 1), (base, 0)]


def test_records_compare_by_value() -> None:
    # Failed before: each read of history builds new FlagRecord objects, and two records of
    # the same entry compared unequal (identity)
    with fast_math(cudnn_benchmark=True, device="cpu", label="equal"):
        pass
    first, second = speedflags.ledger().history[-2:], speedflags.ledger().history[-2:]
    assert first == second and first[0] is not second[0]
    assert len({*first, *second}) == 2
    assert first[0] != first[1]  # the set and the restore differ
    assert first[0] != "a record"
