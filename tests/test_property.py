"""Property: from any starting state, any nesting of specs with exceptions at any depth restores
snapshot() exactly, never produces a mixed TF32 state, and refuses a mixed one unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import torch
from conftest import HAS_NEW_API, C, reset_all, set_autocast_enabled
from hypothesis import given, settings
from hypothesis import strategies as st

import speedflags
from speedflags import DriftWarning, MixedTF32APIError, fast_math


class Injected(Exception):
    pass


# --- starting states: raw torch writes through either API family ---------------------------

NODES = [
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
]
# Values some PyTorch accepts for some node ('bfx9': cuda.matmul on 2.15+). Which node takes
# which is found by trying, in a child process: a write to cuDNN conv/rnn cannot be undone
# exactly in this one (their hidden DEFAULT cannot be written back).
CANDIDATE_VALUES = ["none", "ieee", "tf32", "bf16", "bfx9"]
ACCEPTS_SCRIPT = r"""
import json, sys, torch
accepted = []
for backend, op in json.loads(sys.argv[1]):
    for value in json.loads(sys.argv[2]):
        try:
            torch._C._set_fp32_precision_setter(backend, op, value)
        except RuntimeError:
            continue
        accepted.append([backend, op, value])
print(json.dumps(accepted))
"""


def accepted_node_values() -> list[tuple[tuple[str, str], str]]:
    if not HAS_NEW_API:
        return []
    result = subprocess.run(
        [sys.executable, "-c", ACCEPTS_SCRIPT, json.dumps(NODES), json.dumps(CANDIDATE_VALUES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = [((b, o), v) for b, o, v in json.loads(result.stdout.strip().splitlines()[-1])]
    missing = [node for node in NODES if (node, "tf32") not in found]
    assert not missing, f"the probe found no 'tf32' for {missing}: {result.stderr}"
    return found


NODE_VALUES = accepted_node_values()
node_writes = (
    [st.sampled_from(NODE_VALUES).map(lambda nv: ("node", nv[0], nv[1]))] if NODE_VALUES else []
)
legacy_write = st.one_of(
    st.tuples(st.just("allow_tf32"), st.booleans()),
    st.tuples(st.just("cudnn_tf32"), st.booleans()),
    st.tuples(st.just("precision"), st.sampled_from(["highest", "high", "medium"])),
)
other_write = st.one_of(
    st.tuples(st.just("benchmark"), st.booleans()),
    st.tuples(st.just("sdp_flash"), st.booleans()),
    st.tuples(st.just("sdp_order"), st.permutations([0, 1, 2, 3, 4])),
)
raw_write = st.one_of(legacy_write, other_write, *node_writes)


def apply_raw(write: tuple[Any, ...]) -> None:
    kind = write[0]
    if kind == "node":
        C._set_fp32_precision_setter(*write[1], write[2])
    elif kind == "allow_tf32":
        C._set_cublas_allow_tf32(write[1])
    elif kind == "cudnn_tf32":
        C._set_cudnn_allow_tf32(write[1])
    elif kind == "precision":
        C._set_float32_matmul_precision(write[1])
    elif kind == "benchmark":
        C._set_cudnn_benchmark(write[1])
    elif kind == "sdp_flash":
        C._set_sdp_use_flash(write[1])
    elif kind == "sdp_order" and hasattr(C, "_set_sdp_priority_order"):
        C._set_sdp_priority_order(list(write[1]))


# --- specs -----------------------------------------------------------------------------------

spec_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "tf32": st.booleans(),
        "matmul_precision": st.sampled_from(["highest", "high", "medium"]),
        "cudnn_benchmark": st.booleans(),
        "sdpa": st.sampled_from(["flash", "math", ("efficient", "flash"), ("cudnn", "math")]),
        "amp": st.sampled_from(["bf16", False]),
    },
).filter(
    lambda kw: (
        "tf32" not in kw
        or "matmul_precision" not in kw
        or kw["tf32"] == (kw["matmul_precision"] != "highest")
    )
)
# Code inside a block may change what the block set ("drift"); exit must restore it anyway.
# Each drift write stays within the domains of the block's own levers.
DRIFT_DOMAIN = {
    "tf32": "fp32",
    "matmul_precision": "fp32",
    "cudnn_benchmark": "benchmark",
    "sdpa": "sdpa",
    "amp": "amp",
}
drift_write = st.one_of(
    st.tuples(st.just("fp32"), st.one_of(legacy_write, *node_writes)),
    st.tuples(st.just("benchmark"), st.tuples(st.just("benchmark"), st.booleans())),
    st.tuples(
        st.just("sdpa"),
        st.one_of(
            st.tuples(st.just("sdp_flash"), st.booleans()),
            st.tuples(st.just("sdp_order"), st.permutations([0, 1, 2, 3, 4])),
        ),
    ),
    st.tuples(st.just("amp"), st.tuples(st.just("autocast"), st.booleans())),
)
# each level: the spec, whether to raise inside it (an Exception, KeyboardInterrupt), and drift
level = st.tuples(
    spec_kwargs,
    st.sampled_from([None, None, "error", "interrupt"]),
    st.one_of(st.none(), drift_write),
)


def tf32_is_consistent() -> bool:
    return speedflags.tf32_status().consistent


def drift(kwargs: dict[str, Any], write: tuple[str, tuple[Any, ...]] | None) -> None:
    if write is None or write[0] not in {DRIFT_DOMAIN[name] for name in kwargs}:
        return
    if write[1][0] == "autocast":
        set_autocast_enabled("cpu", write[1][1])
    else:
        apply_raw(write[1])


def run_nested(levels: list[tuple[dict[str, Any], str | None, Any]]) -> None:
    """Enter levels[0], inside it levels[1], ...; check each level comes back exactly."""
    if not levels:
        return
    kwargs, fault, drift_write = levels[0]
    consistent = tf32_is_consistent()
    before = speedflags.snapshot()
    touches_tf32 = "tf32" in kwargs or "matmul_precision" in kwargs
    try:
        with fast_math(device="cpu", **kwargs):
            assert consistent or not touches_tf32, "entered a mixed TF32 state"
            assert tf32_is_consistent() or not consistent, "speedflags produced a mixed state"
            run_nested(levels[1:])
            drift(kwargs, drift_write)
            if fault == "error":
                raise Injected
            if fault == "interrupt":
                raise KeyboardInterrupt
    except MixedTF32APIError:
        assert touches_tf32 and not consistent
    except (Injected, KeyboardInterrupt):
        pass
    assert speedflags.snapshot() == before
    assert tf32_is_consistent() is consistent


@settings(max_examples=300)
@given(start=st.lists(raw_write, max_size=5), levels=st.lists(level, min_size=1, max_size=4))
def test_any_nesting_from_any_start_restores_exactly(
    start: list[tuple[Any, ...]], levels: list[tuple[dict[str, Any], str | None, Any]]
) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DriftWarning)  # drift is injected on purpose
            for write in start:
                apply_raw(write)
            before = speedflags.snapshot()
            run_nested(levels)
        assert speedflags.snapshot() == before
        assert speedflags.ledger().open_frames() == ()
    finally:
        reset_all()


@settings(max_examples=60)
@given(start=st.lists(raw_write, max_size=5), levels=st.lists(spec_kwargs, min_size=1, max_size=3))
def test_heal_makes_any_start_usable(
    start: list[tuple[Any, ...]], levels: list[dict[str, Any]]
) -> None:
    try:
        for write in start:
            apply_raw(write)
        status = speedflags.heal_tf32()
        assert status.consistent
        healed = speedflags.snapshot()
        run_nested([(kw, None, None) for kw in levels])
        assert speedflags.snapshot() == healed
    finally:
        reset_all()


def test_reset_all_really_returns_to_a_fresh_process_reading() -> None:
    # The property tests rely on reset_all(); check it against the first snapshot taken.
    before = speedflags.snapshot()
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("medium")
    reset_all()
    assert speedflags.snapshot() == before
