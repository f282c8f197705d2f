"""The pure model of the TF32 / fp32_precision family: targets, plans, conflicts, healing.

(``speedflags.levers._fp32_model`` and ``_fp32_mixed``.)

These tests build states by hand (what every getter would answer) and never touch torch's
flags, so they describe every PyTorch the package supports: 2.1-2.8 (legacy API only, no
tree), 2.9+ (both families) and 2.15 (cuBLAS's 'bfx9'). Only the last test runs the plans
through the installed PyTorch, to check that the model knows what its setters do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import reset_tf32_family

import speedflags
from speedflags.errors import MixedTF32APIError
from speedflags.levers import _fp32_mixed as mixed
from speedflags.levers import _fp32_model as m
from speedflags.levers import _fp32_torch
from speedflags.levers._base import Unreadable
from speedflags.levers._fp32_model import (
    MATMUL,
    MKLDNN_MATMUL,
    SET_CUBLAS,
    SET_CUDNN,
    SET_NODE,
    SET_PRECISION,
    FamilyState,
)

MIX = Unreadable("RuntimeError", "... mix of the legacy and new APIs ...")
FRESH_NODE_VALUES = {
    "generic": "none",
    "cuda": "none",
    "matmul": "none",
    "conv": "tf32",  # cuDNN's hidden DEFAULT reads 'tf32'
    "rnn": "tf32",
    "mkldnn": "none",
    "mkldnn_matmul": "none",
    "mkldnn_conv": "none",
    "mkldnn_rnn": "none",
}


def nodes(**changed: str) -> tuple[str, ...]:
    """The resolved tree of a fresh 2.9+ process, with ``changed`` nodes."""
    assert set(changed) <= set(FRESH_NODE_VALUES), changed
    return tuple({**FRESH_NODE_VALUES, **changed}.values())


FRESH = (False, True, "highest", nodes())  # a fresh PyTorch 2.9+ (2.13's readings)
FRESH_LEGACY = (False, True, "highest", None)  # a fresh PyTorch 2.1-2.8: no tree
AFTER_HIGH = (True, True, "high", nodes(matmul="tf32", mkldnn_matmul="tf32"))
AFTER_MEDIUM = (True, True, "medium", nodes(matmul="tf32", mkldnn_matmul="bf16"))
CUDA_ALL_TF32 = (True, True, "high", nodes(cuda="tf32", matmul="tf32"))  # cudnn.fp32_precision
BFX9 = (False, True, "highest", nodes(matmul="bfx9"))  # PyTorch 2.15+ only

# Mixed states, as PyTorch 2.13 reads them after a new-API-only write (docs/tf32_policy.md).
MIXED_MATMUL = (MIX, True, MIX, nodes(matmul="tf32"))  # cuda.matmul.fp32_precision = 'tf32'
MIXED_ONEDNN = (False, True, MIX, nodes(mkldnn_matmul="bf16"))  # mkldnn.matmul = 'bf16'
MIXED_CONV = (False, MIX, "highest", nodes(conv="ieee"))  # cudnn.conv = 'ieee'
MIXED_STALE_HIGH = (MIX, True, "high", nodes(matmul="ieee"))  # allow_tf32=True, then 'ieee'

CONSISTENT = [FRESH, FRESH_LEGACY, AFTER_HIGH, AFTER_MEDIUM, CUDA_ALL_TF32, BFX9]
REQUESTS = [("tf32", True), ("tf32", False)] + [("precision", p) for p in m.MATMUL_PRECISIONS]


def target_for(state: FamilyState, kind: str, value: object) -> FamilyState:
    if kind == "tf32":
        return m.tf32_target(state, bool(value))
    return m.precision_target(state, str(value))


def test_the_model_imports_and_plans_without_torch() -> None:
    # The package's __init__ needs torch; the model and its mixed-state rules must not.
    # Load them as submodules of stand-in packages (their __init__ is not run) with every
    # torch import refused.
    levers = os.path.dirname(m.__file__)
    code = textwrap.dedent(
        f"""
        import importlib, sys, types
        sys.modules["torch"] = None  # "import torch" now raises ImportError
        for name, path in (("sf", {os.path.dirname(levers)!r}), ("sf.levers", {levers!r})):
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
        model = importlib.import_module("sf.levers._fp32_model")
        importlib.import_module("sf.levers._fp32_mixed")
        state = (False, True, "highest", None)
        print(model.plan_write(state, model.tf32_target(state, True)).ops)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "(('set_cublas', (True,)),)"


# --- PyTorch 2.1-2.8: the legacy API alone ------------------------------------------------------


def test_legacy_only_tf32_on_writes_the_cublas_flag_alone() -> None:
    target = m.tf32_target(FRESH_LEGACY, True)
    assert target == (True, True, "high", None)
    plan = m.plan_write(FRESH_LEGACY, target)
    assert plan == m.WritePlan(((SET_CUBLAS, (True,)),), None, ())


def test_legacy_only_tf32_off_from_medium_needs_the_precision_setter() -> None:
    medium = (True, True, "medium", None)
    target = m.tf32_target(medium, False)
    assert target == (False, False, "highest", None)
    plan = m.plan_write(medium, target)
    assert plan is not None
    assert plan.ops == ((SET_PRECISION, ("highest",)), (SET_CUDNN, (False,)))


def test_legacy_only_tf32_on_keeps_a_medium_precision() -> None:
    medium = (True, True, "medium", None)
    assert m.tf32_target(medium, True) == medium
    assert m.plan_write(medium, medium) == m.WritePlan((), None, ())


def test_legacy_only_precision_targets() -> None:
    assert m.precision_target(FRESH_LEGACY, "highest") is FRESH_LEGACY
    assert m.precision_target(FRESH_LEGACY, "medium") == (True, True, "medium", None)
    plan = m.plan_write(FRESH_LEGACY, (True, True, "medium", None))
    assert plan is not None and plan.ops == ((SET_PRECISION, ("medium",)),)


def test_legacy_only_state_cannot_be_mixed() -> None:
    assert m.is_consistent(FRESH_LEGACY)
    assert mixed.conflicts(FRESH_LEGACY) == []
    assert mixed.heal_target(FRESH_LEGACY, prefer_cuda=True) == (FRESH_LEGACY, [])
    assert set(m.describe_state(FRESH_LEGACY)) == {
        m.LEGACY_MATMUL,
        m.LEGACY_CUDNN,
        m.LEGACY_PRECISION,
    }


# --- PyTorch 2.9+: both families ------------------------------------------------------------


def test_tf32_on_from_fresh_is_one_legacy_setter_that_also_writes_the_cublas_leaf() -> None:
    target = m.tf32_target(FRESH, True)
    assert target == (True, True, "high", nodes(matmul="tf32"))
    assert m.plan_write(FRESH, target) == m.WritePlan(
        ((SET_CUBLAS, (True,)),), nodes(matmul="tf32"), (MATMUL,)
    )


def test_tf32_off_lets_conv_and_rnn_inherit_again() -> None:
    on = m.tf32_target(FRESH, True)
    target = m.tf32_target(on, False)
    assert target == (False, False, "highest", nodes(matmul="ieee", conv="none", rnn="none"))
    plan = m.plan_write(on, target)
    assert plan is not None
    assert plan.ops == ((SET_CUBLAS, (False,)), (SET_CUDNN, (False,)))


def test_restoring_a_fresh_process_puts_inherit_back_on_the_leaves() -> None:
    # set_float32_matmul_precision('highest') pins explicit 'ieee' leaves; a fresh process
    # has 'none' there, and the parents resolve to 'none', so 'none' is written back.
    plan = m.plan_write(AFTER_HIGH, FRESH)
    assert plan == m.WritePlan(
        (
            (SET_PRECISION, ("highest",)),
            (SET_NODE, ("cuda", "matmul", "none")),
            (SET_NODE, ("mkldnn", "matmul", "none")),
        ),
        FRESH[3],
        (MATMUL, MKLDNN_MATMUL),
    )


def test_a_parent_that_would_leak_through_gets_an_explicit_leaf_value() -> None:
    # cuda.all is 'tf32': after cudnn.allow_tf32=False the leaves inherit 'tf32' again.
    target = m.tf32_target(CUDA_ALL_TF32, False)
    assert target[3] == nodes(cuda="tf32", matmul="ieee", conv="ieee", rnn="ieee")
    plan = m.plan_write(CUDA_ALL_TF32, target)
    assert plan is not None
    assert plan.ops == (
        (SET_CUBLAS, (False,)),
        (SET_CUDNN, (False,)),
        (SET_NODE, ("cuda", "conv", "ieee")),
        (SET_NODE, ("cuda", "rnn", "ieee")),
    )


def test_medium_changes_onednn_matmul_and_is_not_assumed_from_a_stale_legacy_value() -> None:
    assert m.precision_target(FRESH, "medium") == AFTER_MEDIUM
    assert m.precision_target(AFTER_MEDIUM, "medium") is AFTER_MEDIUM
    stale = (True, True, "medium", nodes(matmul="tf32"))  # mkldnn.matmul reset to 'none'
    assert m.precision_target(stale, "medium") == AFTER_MEDIUM
    plan = m.plan_write(FRESH, AFTER_MEDIUM)
    assert plan is not None and plan.ops == ((SET_PRECISION, ("medium",)),)


def test_a_parent_node_change_has_no_fast_plan() -> None:
    generic_ieee = (False, True, "highest", nodes(generic="ieee"))
    assert m.plan_write(generic_ieee, FRESH) is None
    assert m.plan_write(FRESH, generic_ieee) is None


@pytest.mark.parametrize("start", CONSISTENT, ids=repr)
@pytest.mark.parametrize(("kind", "value"), REQUESTS)
def test_every_plan_predicts_its_target_legacy_setters_first(
    start: FamilyState, kind: str, value: object
) -> None:
    target = target_for(start, kind, value)
    assert m.is_consistent(target)
    plan = m.plan_write(start, target)
    assert plan is not None
    assert plan.predicted == target[3]
    names = [name for name, _ in plan.ops]
    assert names == sorted(names, key=lambda name: name == SET_NODE)
    assert len(set(names) - {SET_NODE}) == len([n for n in names if n != SET_NODE])
    for name, args in plan.ops:
        if name == SET_NODE:
            backend, _, value_written = args
            assert not (backend == "cuda" and value_written == "bf16")


# --- mixed states ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "says"),
    [
        (MIXED_MATMUL, "torch.backends.cuda.matmul.fp32_precision is 'tf32'"),
        (MIXED_ONEDNN, "the legacy matmul precision is not 'medium'"),
        (MIXED_CONV, "has no single answer"),
        (MIXED_STALE_HIGH, "allow_tf32 would be True"),
    ],
)
def test_a_mixed_state_is_refused_naming_the_disagreement(state: FamilyState, says: str) -> None:
    assert not m.is_consistent(state)
    assert any(says in sentence for sentence in mixed.conflicts(state))
    with pytest.raises(MixedTF32APIError, match="refusing to change TF32") as info:
        mixed.require_consistent(state, "change TF32")
    assert says in str(info.value) and "Nothing was changed" in str(info.value)


def test_healing_keeps_what_kernels_see() -> None:
    assert mixed.heal_target(MIXED_MATMUL, prefer_cuda=True) == (
        (True, True, "high", nodes(matmul="tf32")),
        [],
    )
    assert mixed.heal_target(MIXED_STALE_HIGH, prefer_cuda=True)[0] == (
        False,
        True,
        "highest",
        nodes(matmul="ieee"),
    )
    healed, notes = mixed.heal_target(MIXED_CONV, prefer_cuda=True)
    assert healed == (False, False, "highest", nodes(conv="ieee", rnn="none"))
    assert "convolutions were kept" in notes[0]


def test_healing_onednn_bf16_without_cublas_tf32_keeps_the_side_that_runs() -> None:
    cuda, cuda_notes = mixed.heal_target(MIXED_ONEDNN, prefer_cuda=True)
    assert cuda == (False, True, "highest", nodes(mkldnn_matmul="ieee"))
    assert "CUDA kernels were kept" in cuda_notes[0]
    cpu, cpu_notes = mixed.heal_target(MIXED_ONEDNN, prefer_cuda=False)
    assert cpu == (True, True, "medium", nodes(matmul="tf32", mkldnn_matmul="bf16"))
    assert "CPU kernels were kept" in cpu_notes[0]


# --- PyTorch 2.15: cuBLAS's 'bfx9' -----------------------------------------------------------


def test_bfx9_is_kept_by_tf32_off_and_replaced_by_highest() -> None:
    off = m.tf32_target(BFX9, False)
    assert off[3] is not None and off[3][MATMUL] == "bfx9"
    highest = m.precision_target(BFX9, "highest")  # reads 'highest' already, but is not IEEE
    assert highest is not BFX9
    assert highest[3] is not None and highest[3][MATMUL] == "ieee"
    assert m.precision_target(FRESH, "highest") is FRESH


def test_bfx9_mixed_with_a_legacy_tf32_precision_is_explained() -> None:
    bfx9_high = (MIX, True, "high", nodes(matmul="bfx9"))
    assert mixed.conflicts(bfx9_high) == [
        "torch.backends.cuda.matmul.fp32_precision is 'bfx9', but the legacy matmul precision "
        "is 'high' or 'medium' (torch.backends.cuda.matmul.allow_tf32 would be True)"
    ]


# --- the model against the installed PyTorch --------------------------------------------------


def _start(kind: str | None) -> None:
    reset_tf32_family()
    if kind == "high":
        torch.set_float32_matmul_precision("high")
    elif kind == "medium":
        torch.set_float32_matmul_precision("medium")


@pytest.mark.parametrize("start", [None, "high", "medium"])
@pytest.mark.parametrize(("kind", "value"), REQUESTS)
def test_the_installed_pytorch_does_what_the_plans_predict(
    start: str | None, kind: str, value: object
) -> None:
    # write_state falls back to a slow path that reads between steps when a prediction
    # is wrong, which would hide a model error; here each plan runs alone and is compared:
    # the request, then the restore of the state before it.
    _start(start)
    try:
        before = _fp32_torch.read_state()
        target = target_for(before, kind, value)
        for current, wanted in ((before, target), (target, before)):
            plan = m.plan_write(current, wanted)
            assert plan is not None
            _fp32_torch._run(plan.ops)
            assert _fp32_torch.read_state() == wanted
    finally:
        reset_tf32_family()
    assert speedflags.tf32_status().consistent
