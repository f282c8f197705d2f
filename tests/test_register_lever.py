"""``speedflags.register_lever``: a lever written in a module of its own (tests/_dict_lever.py,
a setting kept in a dict) becomes a keyword like the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _dict_lever import SETTINGS, WorkersLever
from conftest import last_seq, records_since

import speedflags
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers import registry


@pytest.fixture
def workers() -> Iterator[WorkersLever]:
    lever = WorkersLever()
    speedflags.register_lever(lever)
    try:
        yield lever
    finally:
        speedflags.unregister_lever("workers")
        SETTINGS["workers"] = 1


def test_the_keyword_works_nests_and_restores(workers: WorkersLever) -> None:
    with speedflags.fast_math(workers=4):
        assert SETTINGS["workers"] == 4
        with speedflags.fast_math(**{"workers": 8, "cudnn_benchmark": True}):
            assert SETTINGS["workers"] == 8
        assert SETTINGS["workers"] == 4
    assert SETTINGS["workers"] == 1

    @speedflags.speedup(workers=8, device="cpu")
    def step() -> int:
        return SETTINGS["workers"]

    assert step() == 8 and SETTINGS["workers"] == 1
    with speedflags.Schedule({0: {"workers": 4}, 2: {}}) as schedule:
        schedule.step(0)
        assert SETTINGS["workers"] == 4
        schedule.step(2)
        assert SETTINGS["workers"] == 1


def test_a_bad_value_is_refused_before_any_lever_changes(workers: WorkersLever) -> None:
    import torch

    with pytest.raises(InvalidValueError, match=r"fast_math\(workers=65\): expected 1 to 64"):
        speedflags.fast_math(workers=65, cudnn_benchmark=True)
    with pytest.raises(InvalidTypeError, match=r"fast_math\(workers='4'\): expected an int"):
        speedflags.fast_math(workers="4")
    assert SETTINGS["workers"] == 1 and not torch.backends.cudnn.benchmark


def test_the_history_records_its_set_and_restore(workers: WorkersLever) -> None:
    seq = last_seq()
    with speedflags.fast_math(workers=4, label="more workers"):
        pass
    records = records_since(seq)
    assert [(r.lever, r.action, r.before, r.after) for r in records] == [
        ("workers", "set", 1, 4),
        ("workers", "restore", 4, 1),
    ]
    assert all(r.label == "more workers" for r in records)


def test_snapshot_and_the_report_show_it(workers: WorkersLever) -> None:
    assert speedflags.snapshot()["workers"] == 1
    with speedflags.fast_math(workers=4):
        assert speedflags.snapshot()["workers"] == 4
    from speedflags.report import build_report

    assert build_report()["levers"]["workers"] == 1


def test_unregister_removes_the_keyword(workers: WorkersLever) -> None:
    spec = speedflags.fast_math(workers=4)
    speedflags.unregister_lever("workers")
    try:
        with pytest.raises(InvalidTypeError, match="unexpected keyword argument 'workers'"):
            speedflags.fast_math(workers=4)
        assert "workers" not in speedflags.snapshot()
        with spec:  # a spec built before still works, and restores
            assert SETTINGS["workers"] == 4
        assert SETTINGS["workers"] == 1
    finally:
        speedflags.register_lever(workers)  # the fixture takes it back


@pytest.mark.parametrize("name", ["tf32", "amp", "param_dtype", "device", "model"])
def test_a_taken_name_is_refused(name: str) -> None:
    lever = WorkersLever()
    lever.name = name
    with pytest.raises(InvalidValueError, match=f"the name '{name}' is taken"):
        speedflags.register_lever(lever)
    assert registry.LEVER_NAMES.count(name) <= 1


def test_registering_the_same_name_twice_is_refused(workers: WorkersLever) -> None:
    with pytest.raises(InvalidValueError, match="'workers' is taken \\(a registered lever\\)"):
        speedflags.register_lever(WorkersLever())


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"name": "two words"}, InvalidValueError, "not a keyword argument name"),
        ({"scope": "model"}, InvalidValueError, "valid: 'process', 'thread'"),
        ({"domain": "fp32_precision"}, InvalidValueError, "domain 'fp32_precision' is tf32's"),
    ],
)
def test_a_malformed_lever_is_refused(change: dict[str, Any], error: type, words: str) -> None:
    lever = WorkersLever()
    for attribute, value in change.items():
        setattr(lever, attribute, value)
    with pytest.raises(error, match=words):
        speedflags.register_lever(lever)
    assert "workers" not in registry.LEVER_NAMES


def test_something_that_is_no_lever_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(InvalidTypeError, match=r"it has no name, read, apply"):
        speedflags.register_lever(object())


def test_a_built_in_lever_stays_and_an_unknown_name_is_refused() -> None:
    with pytest.raises(InvalidValueError, match="a built-in lever stays registered"):
        speedflags.unregister_lever("cudnn_benchmark")
    with pytest.raises(InvalidValueError, match="no such registered lever"):
        speedflags.unregister_lever("workers")


def test_the_leak_plugin_reports_a_registered_lever_a_test_leaves_changed(
    pytester: pytest.Pytester,
) -> None:
    # The lever is registered when the inner session imports its test module (after the
    # plugin started watching: a conftest's pytest_configure would come before), and one test
    # changes its setting without putting it back: that test fails, naming the lever and both
    # values, and the setting is put back for the next test.
    pytester.makeconftest(
        """
        import speedflags

        def pytest_unconfigure(config):  # this session runs in the outer test's process
            speedflags.unregister_lever("workers")
        """
    )
    pytester.makepyfile(
        """
        import speedflags
        from _dict_lever import SETTINGS, WorkersLever

        speedflags.register_lever(WorkersLever())

        def test_leaves_it_changed():
            SETTINGS["workers"] = 7

        def test_sees_it_put_back():
            assert SETTINGS["workers"] == 1

        def test_a_block_restores_it():
            with speedflags.fast_math(workers=4):
                assert SETTINGS["workers"] == 4
        """
    )
    try:
        result = pytester.runpytest("-p", "speedflags.pytest_plugin", "--speedflags-leaks=fail")
    finally:
        SETTINGS["workers"] = 1
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_leaves_it_changed left torch flags changed (--speedflags-leaks=fail)*",
            "  workers: 1 -> 7",
        ]
    )
    assert "workers" not in registry.LEVER_NAMES
