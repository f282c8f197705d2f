"""Reading and writing PyTorch's fp32-precision family: the torch side of :mod:`._fp32_model`.

:func:`read_state` reads every getter of both API families without ever raising (a legacy
getter that would raise the mixed-API error reads as :class:`~speedflags.Unreadable`).
:func:`write_state` and :func:`transition` run the model's plans through PyTorch's setters
and read back what they wrote; the caller compares the result with the target.

Before 2.9 there is no fp32_precision tree (:data:`HAS_NEW_API` is False) and the legacy
getters and setters are used alone. The policy is in ``docs/tf32_policy.md``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Hashable, List, Optional, Tuple, Union

import torch
import torch._C as torch_C

from ._base import Unreadable
from ._fp32_model import (
    CUDA,
    F_NODES,
    GENERIC,
    LEAVES,
    MKLDNN,
    NODES,
    PARENT,
    SET_CUBLAS,
    SET_CUDNN,
    SET_NODE,
    SET_PRECISION,
    FamilyState,
    Op,
    WritePlan,
    is_consistent,
    node_value,
    plan_write,
)

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

# Feature detection, never version strings (the tree appeared in 2.9).
HAS_NEW_API: bool = hasattr(torch.backends, "fp32_precision") and hasattr(
    _C, "_get_fp32_precision_getter"
)

# --- quiet legacy access ---------------------------------------------------------------------

# PyTorch 2.9.x warns once per process on legacy get/set ("Please use the new API settings").
# Our own deliberate legacy calls must not spend that warning, and must not show it either;
# we silence it for the first call of each accessor only (it is warn-once), so the hot path
# pays a set lookup, not a catch_warnings.
_DEPRECATION = re.compile(r"new API|deprecat", re.IGNORECASE)
_quieted: set[str] = set()


def _quiet_first(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    if name in _quieted:
        return fn(*args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn(*args)
        finally:
            _quieted.add(name)
            _replay_but_deprecations(caught)


def _replay_but_deprecations(caught: List[warnings.WarningMessage]) -> None:
    # A function of its own: this loop inside _quiet_first's `with` would be a hole in it on
    # Python 3.13 (tests/test_exception_table_holes.py).
    for w in caught:
        if not _DEPRECATION.search(str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _warm_up_legacy_getters() -> None:
    # Spend (silently) the warn-once deprecation warning of the legacy getters, so that the
    # readers below call them directly. Reading has no side effect on the flags.
    for name, getter in (
        ("get_cublas", _C._get_cublas_allow_tf32),
        ("get_cudnn", _C._get_cudnn_allow_tf32),
        ("get_precision", _C._get_float32_matmul_precision),
    ):
        try:
            _quiet_first(name, getter)
        except RuntimeError:
            pass


_warm_up_legacy_getters()

# --- reading ---------------------------------------------------------------------------------

_get_cublas: Callable[[], bool] = _C._get_cublas_allow_tf32
_get_cudnn: Callable[[], bool] = _C._get_cudnn_allow_tf32
_get_precision: Callable[[], str] = _C._get_float32_matmul_precision
_get_node: Callable[[str, str], str] = getattr(_C, "_get_fp32_precision_getter", None)  # type: ignore[assignment]
_set_node: Callable[[str, str, str], None] = getattr(_C, "_set_fp32_precision_setter", None)  # type: ignore[assignment]

# The model's setter names -> PyTorch's setters (SET_NODE is never planned before 2.9).
_SETTERS: dict[str, Callable[..., Any]] = {
    SET_CUBLAS: _C._set_cublas_allow_tf32,
    SET_PRECISION: _C._set_float32_matmul_precision,
    SET_CUDNN: _C._set_cudnn_allow_tf32,
    SET_NODE: _set_node,
}


def read_state() -> FamilyState:
    """Every getter of both families. Never raises."""
    # Inlined (no helper calls): this runs twice per frame.
    matmul: Union[bool, Unreadable]
    cudnn: Union[bool, Unreadable]
    precision: Union[str, Unreadable]
    try:
        matmul = _get_cublas()
    except RuntimeError as exc:
        matmul = Unreadable.from_exception(exc)
    try:
        cudnn = _get_cudnn()
    except RuntimeError as exc:
        cudnn = Unreadable.from_exception(exc)
    try:
        precision = _get_precision()
    except RuntimeError as exc:
        precision = Unreadable.from_exception(exc)
    if not HAS_NEW_API:
        return (matmul, cudnn, precision, None)
    g = _get_node
    nodes = (
        g("generic", "all"),
        g("cuda", "all"),
        g("cuda", "matmul"),
        g("cuda", "conv"),
        g("cuda", "rnn"),
        g("mkldnn", "all"),
        g("mkldnn", "matmul"),
        g("mkldnn", "conv"),
        g("mkldnn", "rnn"),
    )
    return (matmul, cudnn, precision, nodes)


# --- writing ---------------------------------------------------------------------------------

# A plan's setter calls, resolved to PyTorch's functions.
Calls = Tuple[Tuple[Callable[..., Any], Tuple[Any, ...]], ...]

# Plans depend only on (current, target), and a training loop makes the same few transitions
# every step, so they are computed once. The first run of a plan is checked against a read of
# everything it wrote; a plan that reached its target once is trusted after that (PyTorch's
# setters do not change behaviour within a process), which keeps enter/exit cheap. Frames
# still read the whole family on entry and exit, so anything else that changed is seen.
# Bounded: cleared when full.
_PLANS: dict[tuple[FamilyState, FamilyState], Optional[WritePlan]] = {}
# (current, target) -> the plan's setter calls, once the plan has reached its target
_TRUSTED: dict[tuple[FamilyState, FamilyState], Calls] = {}
# lever request -> (target, setter calls): one dict lookup per lever write on the hot path
_FAST: dict[Hashable, tuple[FamilyState, Calls]] = {}
_MAX_PLANS = 512


def write_state(target: FamilyState, current: FamilyState) -> FamilyState:
    """Make every getter of both families answer as in ``target``; return the state read after.

    ``target`` must be consistent; ``current`` is the state now. The caller compares the
    result with ``target``. After the planned writes, the legacy getters and every node
    written are read back; if that does not match (a PyTorch whose setters behave
    differently, or a parent node that must change), the slow path reads between steps.
    """
    if current == target:
        return current
    key = (current, target)
    trusted = _TRUSTED.get(key)
    if trusted is not None:  # ran before through the checked path below: setters are quiet
        for fn, args in trusted:
            fn(*args)
        return target
    plan = _PLANS.get(key, _MISSING)
    if plan is _MISSING:
        if not is_consistent(target):  # pragma: no cover - a programming error, not user input
            raise ValueError(f"internal error: refusing to write a mixed state {target!r}")
        plan = plan_write(current, target)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
            _TRUSTED.clear()
            _FAST.clear()
        _PLANS[key] = plan
    if plan is None:
        return _write_slow(target, current)
    _run(plan.ops)
    predicted = plan.predicted
    if predicted is not None:
        nodes = list(predicted)
        for node in plan.written:
            nodes[node] = _get_node(*NODES[node])
        predicted = tuple(nodes)
    # the legacy getters read back (a full read: this checked path runs once per plan)
    after: FamilyState = (*read_state()[:F_NODES], predicted)
    if after == target:
        _TRUSTED[key] = tuple((_SETTERS[name], args) for name, args in plan.ops)
        return after
    return _write_slow(target, read_state())


def transition(
    request: Hashable,
    current: FamilyState,
    make_target: Callable[..., FamilyState],
    *args: Any,
) -> tuple[FamilyState, FamilyState, Calls | None]:
    """Write ``make_target(*args)`` over ``current``; return ``(state after, target, calls)``.

    ``request`` must determine the target together with ``current`` (e.g.
    ``("tf32", current, True)``). Once a request has been written through a checked plan,
    it costs one dict lookup and its setter calls. A state after equal to the target is
    the target object itself; ``calls`` are then the setter calls that reach it from
    ``current`` (trusted: the caller may replay them for the same request), else None.
    """
    hit = _FAST.get(request)
    if hit is not None:
        target, ops = hit
        for fn, fn_args in ops:
            fn(*fn_args)
        return target, target, ops
    target = make_target(*args)
    after = write_state(target, current)
    if after != target:
        return after, target, None
    written = () if current == target else _TRUSTED.get((current, target))
    if written is not None:
        _FAST[request] = (target, written)
    return target, target, written


def _run(ops: Tuple[Op, ...]) -> None:
    for name, args in ops:
        if name == SET_NODE:
            _set_node(*args)
        else:
            _quiet_first(name, _SETTERS[name], *args)


_MISSING: Any = object()


def _write_slow(target: FamilyState, current: FamilyState) -> FamilyState:
    # Reads between the steps instead of predicting: parents first (root first), then the
    # legacy setters, then the leaves from what PyTorch really reports.
    tnodes = target[F_NODES]
    if tnodes is not None and current[F_NODES] is not None:
        for node in (GENERIC, CUDA, MKLDNN):
            if _get_node(*NODES[node]) != tnodes[node]:
                parent = PARENT[node]
                inherit = parent is not None and _get_node(*NODES[parent]) == tnodes[node]
                _set_node(*NODES[node], "none" if inherit else tnodes[node])
        current = read_state()
    plan = plan_write(current, target)
    if plan is not None:  # the legacy setters only; leaves are corrected from a fresh read
        _run(tuple(op for op in plan.ops if op[0] != SET_NODE))
    after = read_state()
    if after != target and tnodes is not None and after[F_NODES] is not None:
        resolved = list(after[F_NODES])
        for leaf, parent in LEAVES:
            want = tnodes[leaf]
            if resolved[leaf] != want:
                _set_node(*NODES[leaf], node_value(want, resolved[parent]))
        after = read_state()
    return after
