"""The ``deterministic`` and ``reduced_precision_reduction`` levers, with the real torch on a CPU.

Every flag here is a plain process-wide store that a CPU-only build reads and writes (the
reduction flags too, although no CPU kernel reads them), so nothing is mocked: what a CPU
cannot show is a reduction flag changing a GEMM (``verify``'s probe does that on CUDA).
"""

from __future__ import annotations

import itertools
import textwrap
import warnings
from typing import Any

import pytest
import torch

import speedflags
from speedflags import DriftWarning, InvalidTypeError, InvalidValueError, fast_math
from speedflags._watch.setters import SETTERS
from speedflags.levers import reductions
from speedflags.levers.registry import lever_spec

C: Any = torch._C
HAS_SPLITK = isinstance(C._get_cublas_allow_fp16_reduced_precision_reduction(), tuple)
HAS_ACCUMULATION = hasattr(C, "_get_cublas_allow_fp16_accumulation")
PLUGIN = ("-p", "speedflags.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning")


def det_state() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        bool(torch.backends.cudnn.deterministic),
    )


def set_det(state: tuple[bool, bool, bool]) -> None:
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    torch.backends.cudnn.deterministic = state[2]


WANTED = {True: (True, False, True), "warn": (True, True, True), False: (False, False, False)}


# --- deterministic ------------------------------------------------------------------------


@pytest.mark.parametrize("found", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("value", [True, "warn", False])
def test_deterministic_restores_every_combination_exactly(
    found: tuple[bool, bool, bool], value: Any
) -> None:
    set_det(found)  # e.g. warn_only left on with the mode off, or cudnn.deterministic alone
    assert det_state() == found
    before = speedflags.snapshot()
    try:
        with fast_math(deterministic=value, device="cpu"):
            assert det_state() == WANTED[value]
            assert speedflags.snapshot()["deterministic"] == {
                "torch.are_deterministic_algorithms_enabled()": WANTED[value][0],
                "torch.is_deterministic_algorithms_warn_only_enabled()": WANTED[value][1],
                "torch.backends.cudnn.deterministic": WANTED[value][2],
            }
        assert det_state() == found
        assert speedflags.snapshot() == before
    finally:
        set_det((False, False, False))


def test_deterministic_true_raises_on_a_nondeterministic_op_and_warn_warns() -> None:
    with speedflags.deterministic(True), pytest.raises(RuntimeError, match="deterministic"):
        _nondeterministic_cpu_op()
    with speedflags.deterministic("warn"), pytest.warns(UserWarning, match="deterministic"):
        _nondeterministic_cpu_op()
    _nondeterministic_cpu_op()  # off again: no error, no warning
    assert det_state() == (False, False, False)


def _nondeterministic_cpu_op() -> None:
    # put_ without accumulate has no deterministic implementation, on a CPU too (2.1 to 2.13)
    torch.zeros(3).put_(torch.tensor([0, 1, 1]), torch.ones(3), accumulate=False)


def test_deterministic_nests_and_each_exit_restores_its_entry() -> None:
    with speedflags.deterministic("warn"):
        with speedflags.deterministic(True):
            assert det_state() == (True, False, True)
            with speedflags.deterministic(False):
                assert det_state() == (False, False, False)
            assert det_state() == (True, False, True)
        assert det_state() == (True, True, True)
    assert det_state() == (False, False, False)


def test_deterministic_drift_inside_the_block_warns_and_is_undone() -> None:
    with pytest.warns(DriftWarning, match="deterministic"):
        with fast_math(deterministic="warn", device="cpu"):
            torch.use_deterministic_algorithms(False)  # code inside the block changes it
            torch.backends.cudnn.deterministic = False
    assert det_state() == (False, False, False)
    set_det((False, True, True))
    try:
        with pytest.warns(DriftWarning):
            with fast_math(deterministic=True, device="cpu"):
                torch.use_deterministic_algorithms(True, warn_only=True)
        assert det_state() == (False, True, True)  # the combination found, not a default
    finally:
        set_det((False, False, False))


def test_deterministic_true_with_cudnn_benchmark_is_refused_naming_both() -> None:
    for make in (
        lambda: fast_math(deterministic=True, cudnn_benchmark=True),
        lambda: speedflags.speedup(deterministic=True, cudnn_benchmark=True),
    ):
        with pytest.raises(InvalidValueError) as info:
            make()
        message = str(info.value)
        assert "deterministic=True" in message and "cudnn_benchmark=True" in message
        assert "contradictory" in message
    assert det_state() == (False, False, False)  # refused at spec time: nothing written
    with fast_math(deterministic="warn", cudnn_benchmark=True, device="cpu"):
        assert det_state() == (True, True, True)


@pytest.mark.parametrize("outer_first", ["cudnn_benchmark", "deterministic"])
def test_the_two_nested_are_refused_as_one_spec_with_both_is(outer_first: str) -> None:
    # Failed before: deterministic=True nested inside cudnn_benchmark=True left both on, while
    # one spec with both is refused. Nested, the inner enter is refused the same way (an
    # InvalidValueError saying "contradictory"), and changes nothing.
    outer = (
        {"cudnn_benchmark": True} if outer_first == "cudnn_benchmark" else {"deterministic": True}
    )
    inner = (
        {"deterministic": True} if outer_first == "cudnn_benchmark" else {"cudnn_benchmark": True}
    )
    with fast_math(**outer, tf32=True, device="cpu"):
        inside = speedflags.snapshot()

        def in_a_block() -> None:
            with fast_math(**inner, matmul_precision="high", device="cpu"):
                pass

        for run in (in_a_block, speedflags.speedup(**inner, device="cpu")(lambda: None)):
            with pytest.raises(InvalidValueError) as info:
                run()
            message = str(info.value)
            assert message.startswith(
                f"{'deterministic' if outer_first == 'cudnn_benchmark' else 'cudnn_benchmark'}"
                "=True entered while "
            )
            assert "contradictory, as fast_math(deterministic=True, cudnn_benchmark=True) is" in (
                message
            )
            assert speedflags.snapshot() == inside  # rolled back whole
        if outer_first == "cudnn_benchmark":  # the ways out the message gives
            with fast_math(deterministic=True, cudnn_benchmark=False, device="cpu"):
                assert det_state() == (True, False, True) and not torch.backends.cudnn.benchmark
            with speedflags.deterministic("warn"):  # warn-only: allowed, as in one spec
                assert det_state() == (True, True, True) and torch.backends.cudnn.benchmark
    assert det_state() == (False, False, False) and not torch.backends.cudnn.benchmark


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("loud", InvalidValueError, ["deterministic='loud'", "True, False, 'warn'"]),
        (1, InvalidTypeError, ["deterministic=1", "True, False or 'warn'", "int"]),
    ],
)
def test_bad_deterministic_values_name_argument_value_and_choices(
    value: Any, error: type, words: list
) -> None:
    with pytest.raises(error) as info:
        fast_math(deterministic=value)
    for word in words:
        assert word in str(info.value)
    with pytest.raises(error, match=r"deterministic\(mode="):
        speedflags.deterministic(value)


def test_deterministic_takes_effect_on_cpu_and_is_never_a_tune_candidate() -> None:
    spec = lever_spec("deterministic")
    effect = spec.lever().available(True, torch.device("cpu"))
    assert effect.effective and "slower" in effect.reason
    assert spec.candidates == () and spec.baseline is False and spec.scope == "process"
    assert "slower" in spec.accuracy


# --- reduced_precision_reduction ----------------------------------------------------------


def red_state() -> Any:
    return reductions.read_state()


def test_reduction_flags_are_settable_on_this_cpu_build() -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        assert matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction = True


FOUND = [
    ((True, True), (True, True), False),
    ((False, True), (True, True), True),
    ((False, False), (False, True), False),
    ((False, False), (False, False), True),
]


def _for_this_torch(state: Any) -> Any:
    fp16, bf16, accumulation = state
    pair = (lambda p: p) if HAS_SPLITK else (lambda p: (p[0], None))
    return pair(fp16), pair(bf16), accumulation if HAS_ACCUMULATION else None


@pytest.mark.parametrize("found", FOUND)
@pytest.mark.parametrize("value", [True, False])
def test_reductions_restore_exactly(found: Any, value: bool) -> None:
    lever = lever_spec("reduced_precision_reduction").lever()
    pristine = red_state()
    start = _for_this_torch(found)
    lever.restore(start, red_state())
    assert red_state() == start
    before = speedflags.snapshot()
    try:
        with fast_math(reduced_precision_reduction=value, device="cpu"):
            matmul = torch.backends.cuda.matmul
            assert matmul.allow_fp16_reduced_precision_reduction is value
            assert matmul.allow_bf16_reduced_precision_reduction is value
            if HAS_ACCUMULATION and not value:
                assert matmul.allow_fp16_accumulation is False
            if HAS_SPLITK and value:  # (True, False) is refused by PyTorch: split-K on
                assert matmul.allow_fp16_reduced_precision_reduction_split_k is True
        assert red_state() == start
        assert speedflags.snapshot() == before
    finally:
        lever.restore(pristine, red_state())


def test_reductions_nest_and_drift_is_undone() -> None:
    with speedflags.reduced_precision_reduction(False):
        with speedflags.reduced_precision_reduction(True):
            assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        assert not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    pristine = red_state()
    with pytest.warns(DriftWarning, match="reduced_precision_reduction"):
        with speedflags.reduced_precision_reduction(False):
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    assert red_state() == pristine


def test_reductions_have_no_effect_on_cpu_and_are_a_gpu_tune_candidate() -> None:
    spec = lever_spec("reduced_precision_reduction")
    effect = spec.lever().available(True, torch.device("cpu"))
    assert not effect.effective and "CUDA" in effect.reason
    assert spec.candidates == (True,) and spec.baseline is False and "mm" in spec.ops
    with pytest.raises(InvalidTypeError, match=r"fast_math\(reduced_precision_reduction='on'\)"):
        fast_math(reduced_precision_reduction="on")
    with pytest.raises(speedflags.LeverUnavailableError, match="no effect on cpu"):
        with fast_math(reduced_precision_reduction=True, device="cpu", strict=True):
            pass


# --- snapshot, watch, the leak plugin -----------------------------------------------------


def test_snapshot_includes_both() -> None:
    snap = speedflags.snapshot()
    assert snap["deterministic"]["torch.backends.cudnn.deterministic"] is False
    flags = snap["reduced_precision_reduction"]
    assert flags["torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"] is True
    assert ("torch.backends.cuda.matmul.allow_fp16_accumulation" in flags) == HAS_ACCUMULATION


def test_watch_names_the_writers() -> None:
    with speedflags.watch() as w:
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    reasons = [(r.lever, r.reason) for r in w.records]
    line = test_watch_names_the_writers.__code__.co_firstlineno
    assert reasons[0][0] == "deterministic"
    assert reasons[0][1].startswith("torch.use_deterministic_algorithms(True, warn_only=False) by")
    assert reasons[0][1].endswith(f"test_levers_determinism.py:{line + 2}")
    assert reasons[1] == (
        "reduced_precision_reduction",
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction set to False by "
        f"test_watch_names_the_writers at {__file__}:{line + 3}",
    )
    assert len(reasons) == 4


def test_every_new_setter_is_watched() -> None:
    for name in (
        "_set_deterministic_algorithms",
        "_set_cudnn_deterministic",
        "_set_cublas_allow_fp16_reduced_precision_reduction",
        "_set_cublas_allow_bf16_reduced_precision_reduction",
        "_set_cublas_allow_fp16_accumulation",
    ):
        assert SETTERS[name].lever in ("deterministic", "reduced_precision_reduction")


def test_leak_plugin_fails_restores_and_names_a_deterministic_leak(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_det=textwrap.dedent(
            """\
            import torch


            def test_leaves_it_on():
                torch.use_deterministic_algorithms(True)


            def test_next_starts_clean():
                assert not torch.are_deterministic_algorithms_enabled()
            """
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pytester.runpytest(*PLUGIN, "--speedflags-leaks=fail")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_det.py::test_leaves_it_on left torch flags changed "
            "(--speedflags-leaks=fail); speedflags put them back:",
            "  deterministic:",
            "    torch.are_deterministic_algorithms_enabled(): False -> True",
            "    write: torch.use_deterministic_algorithms(True, warn_only=False) by "
            f"test_leaves_it_on at {pytester.path / 'test_det.py'}:5",
        ]
    )
    assert det_state() == (False, False, False)
