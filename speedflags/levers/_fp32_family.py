"""PyTorch's fp32-precision family: the legacy TF32 API and the 2.9+ ``fp32_precision`` tree.

Both API families describe one piece of state. PyTorch's legacy *getters* raise
``RuntimeError("... mix of the legacy and new APIs ...")`` whenever the two disagree, and
PyTorch's own compile/autotune/benchmark paths call those getters. This module reads the
family without ever raising and writes it so that both families stay readable
(``../shared/research/tf32_api.md`` has the measured rules this code follows):

1. Legacy setters first (they update both views); then new-API corrections of the leaf
   nodes, putting ``'none'`` (inherit) back where the parent already resolves to the wanted
   value and an explicit value where a parent would leak through.
2. Every write is followed by a read; callers compare it with the intended state.

Two things no API can restore (documented for users in the README): cuDNN conv/rnn start
at a hidden ``DEFAULT`` that cannot be written back, and an inherited value cannot be told
from an explicit one through the getters.

Versions (the research describes 2.13; this module is tested on 2.4.1, 2.13 and 2.15):

- Before 2.9 there is no tree: :data:`HAS_NEW_API` is False, ``FamilyState[F_NODES]`` is
  None, and reads and writes use the three legacy getters and setters alone.
- 2.15 repeats every probe of the research with the same readings, with two changes.
  ``cuda.matmul`` (and no other node) also accepts ``'bfx9'``, cuBLAS's BF16x9 emulation of
  fp32. The legacy getters see it as not-TF32 (``allow_tf32`` False, precision 'highest')
  and raise when it meets a legacy 'high' or 'medium'. Node values are opaque strings here,
  so 'bfx9' is read, refused when mixed, healed and restored like any other value;
  ``tf32=False`` keeps it (it is not TF32) and ``matmul_precision='highest'`` replaces it
  with 'ieee', as ``torch.set_float32_matmul_precision('highest')`` does. And most of
  PyTorch's compile-path readers moved to the new API's getters (dynamo's global-state key,
  inductor's precompile and cache keys, ``torch.utils.benchmark``; pytorch#196860), so a
  mixed state breaks fewer of them; inductor's bmm and conv templates still read the legacy
  ``allow_tf32``, so the never-mixed policy stays as it is.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Final, Hashable, NamedTuple, Optional, Tuple, Union

import torch

from ..errors import MixedTF32APIError
from ._base import Unreadable

_C: Any = torch._C

# Feature detection, never version strings (the tree appeared in 2.9).
HAS_NEW_API: bool = hasattr(torch.backends, "fp32_precision") and hasattr(
    _C, "_get_fp32_precision_getter"
)

# The nine nodes of the fp32_precision tree, as (backend, op) pairs.
NODES: Tuple[Tuple[str, str], ...] = (
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)
GENERIC, CUDA, MATMUL, CONV, RNN, MKLDNN, MKLDNN_MATMUL, MKLDNN_CONV, MKLDNN_RNN = range(9)
PARENT: Tuple[Optional[int], ...] = (
    None,
    GENERIC,
    CUDA,
    CUDA,
    CUDA,
    GENERIC,
    MKLDNN,
    MKLDNN,
    MKLDNN,
)
# Leaves with their parent (for leaves the parent always exists).
LEAVES: Tuple[Tuple[int, int], ...] = (
    (MATMUL, CUDA),
    (CONV, CUDA),
    (RNN, CUDA),
    (MKLDNN_MATMUL, MKLDNN),
    (MKLDNN_CONV, MKLDNN),
    (MKLDNN_RNN, MKLDNN),
)

# How users see each node: the attribute that reads it.
NODE_NAMES: Tuple[str, ...] = (
    "torch.backends.fp32_precision",
    "torch.backends.cudnn.fp32_precision",  # sic: this attribute is the cuda "all" node
    "torch.backends.cuda.matmul.fp32_precision",
    "torch.backends.cudnn.conv.fp32_precision",
    "torch.backends.cudnn.rnn.fp32_precision",
    "torch.backends.mkldnn.fp32_precision",
    "torch.backends.mkldnn.matmul.fp32_precision",
    "torch.backends.mkldnn.conv.fp32_precision",
    "torch.backends.mkldnn.rnn.fp32_precision",
)
LEGACY_MATMUL = "torch.backends.cuda.matmul.allow_tf32"
LEGACY_CUDNN = "torch.backends.cudnn.allow_tf32"
LEGACY_PRECISION = "torch.get_float32_matmul_precision()"

MATMUL_PRECISIONS = ("highest", "high", "medium")

Legacy = Union[bool, str, Unreadable]


# Every getter of both families: (torch.backends.cuda.matmul.allow_tf32,
# torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(), resolved
# fp32_precision per NODES or None before 2.9); legacy values are Unreadable when they raise.
# An exact tuple of atomic values, not a NamedTuple: the ledger's bounded history holds
# thousands of these, and the garbage collector can stop tracking exact tuples of atomic
# values but never a tuple subclass (measured: ~23% of a frame's cost was GC traversal).
FamilyState = Tuple[Any, Any, Any, Optional[Tuple[str, ...]]]
F_MATMUL: Final = 0
F_CUDNN: Final = 1
F_PRECISION: Final = 2
F_NODES: Final = 3


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
# The legacy setters, bound once like _set_node: speedflags.watch() wraps the torch._C
# names while it runs, and the cached write plans must keep calling the originals after.
_set_cublas: Callable[[bool], None] = _C._set_cublas_allow_tf32
_set_cudnn: Callable[[bool], None] = _C._set_cudnn_allow_tf32
_set_precision: Callable[[str], None] = _C._set_float32_matmul_precision


def _read_legacy() -> tuple[Any, Any, Any]:
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
    return matmul, cudnn, precision


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


def is_consistent(state: FamilyState) -> bool:
    """True when every legacy getter answers (none would raise the mixed-API error)."""
    return not (
        isinstance(state[F_MATMUL], Unreadable)
        or isinstance(state[F_CUDNN], Unreadable)
        or isinstance(state[F_PRECISION], Unreadable)
    )


# --- explaining a mixed state ----------------------------------------------------------------


def _inherited_note(nodes: Tuple[str, ...], node: int) -> str:
    parents = []
    parent = PARENT[node]
    while parent is not None:
        if nodes[parent] != "none":
            parents.append(f"{NODE_NAMES[parent]} is {nodes[parent]!r}")
        parent = PARENT[parent]
    return f" ({'; '.join(parents)})" if parents else ""


def conflicts(state: FamilyState) -> list[str]:
    """One sentence per disagreement between the legacy and the new API. Empty if none."""
    found: list[str] = []
    nodes = state[F_NODES]
    if nodes is None:
        return found  # a legacy-only PyTorch cannot be mixed
    mm = nodes[MATMUL]
    if isinstance(state[F_MATMUL], Unreadable):
        if mm == "tf32":
            found.append(
                f"{NODE_NAMES[MATMUL]} is 'tf32'{_inherited_note(nodes, MATMUL)}, but the legacy "
                f"matmul precision is 'highest' ({LEGACY_MATMUL} would be False)"
            )
        else:
            found.append(
                f"{NODE_NAMES[MATMUL]} is {mm!r}{_inherited_note(nodes, MATMUL)}, but the legacy "
                f"matmul precision is 'high' or 'medium' ({LEGACY_MATMUL} would be True)"
            )
    if isinstance(state[F_PRECISION], Unreadable) and not isinstance(state[F_MATMUL], Unreadable):
        kmm = nodes[MKLDNN_MATMUL]
        legacy_needs = {"bf16": "'medium'", "tf32": "'high'"}.get(kmm, "a matching value")
        found.append(
            f"{NODE_NAMES[MKLDNN_MATMUL]} is {kmm!r}{_inherited_note(nodes, MKLDNN_MATMUL)}, but "
            f"the legacy matmul precision is not {legacy_needs}"
        )
    if isinstance(state[F_CUDNN], Unreadable):
        conv, rnn = nodes[CONV], nodes[RNN]
        if (conv == "tf32") != (rnn == "tf32"):
            found.append(
                f"{NODE_NAMES[CONV]} is {conv!r} but {NODE_NAMES[RNN]} is {rnn!r}, so "
                f"{LEGACY_CUDNN} has no single answer"
            )
        else:
            found.append(
                f"{NODE_NAMES[CONV]} and {NODE_NAMES[RNN]} are {conv!r}"
                f"{_inherited_note(nodes, CONV)}, but the legacy {LEGACY_CUDNN} is "
                f"{conv != 'tf32'}"
            )
    return found


def require_consistent(state: FamilyState, action: str) -> None:
    """Raise :class:`MixedTF32APIError` (changing nothing) if ``state`` is mixed."""
    if is_consistent(state):
        return
    details = conflicts(state) or ["a legacy TF32 getter raises"]
    raise MixedTF32APIError(
        f"refusing to {action}: PyTorch's legacy and new TF32 APIs disagree, so PyTorch's own "
        "compile and autotune paths would raise 'mix of the legacy and new APIs'. "
        + " ".join(f"{d}." for d in details)
        + " Nothing was changed. Fix: call speedflags.heal_tf32() to make both API families "
        "agree while keeping the precision kernels use now, then change TF32 only through "
        "speedflags (fast_math(tf32=...)) or through one API family." + _mixed_note(state)
    )


def _mixed_note(state: FamilyState) -> str:
    from .._watcher import mixed_note  # local: _watcher imports this module

    return mixed_note(state)


# --- targets ---------------------------------------------------------------------------------


_TARGETS: dict[tuple[Any, ...], FamilyState] = {}


def tf32_target(state: FamilyState, enabled: bool) -> FamilyState:
    """The state ``tf32=enabled`` asks for from ``state`` (memoized: a pure function)."""
    key = ("tf32", state, enabled)
    target = _TARGETS.get(key)
    if target is None:
        if len(_TARGETS) >= _MAX_PLANS:
            _TARGETS.clear()
        target = _TARGETS[key] = _tf32_target(state, enabled)
    return target


def _tf32_target(state: FamilyState, enabled: bool) -> FamilyState:
    """The state ``tf32=enabled`` asks for, starting from a consistent ``state``.

    On: cuBLAS matmul and cuDNN conv/rnn in TF32; the legacy precision becomes 'high' unless
    it already allows TF32 ('high' or 'medium', kept). Off: full fp32 everywhere the legacy
    API can see, i.e. precision 'highest', which also takes oneDNN matmul off bf16/tf32.
    A cuBLAS mode that is not TF32 and that the legacy API cannot see (2.15's 'bfx9') is
    kept by ``tf32=False``; ``matmul_precision='highest'`` replaces it with 'ieee'.
    """
    if enabled:
        precision = state[F_PRECISION] if state[F_PRECISION] in ("high", "medium") else "high"
    else:
        precision = "highest"
    nodes = state[F_NODES]
    if nodes is not None and enabled:
        nodes = (*nodes[:MATMUL], "tf32", "tf32", "tf32", *nodes[RNN + 1 :])
    elif nodes is not None:
        n = list(nodes)
        if n[MATMUL] == "tf32":
            n[MATMUL] = "ieee"  # what the legacy setter writes
        if n[MKLDNN_MATMUL] in ("bf16", "tf32"):
            n[MKLDNN_MATMUL] = "ieee"
        for leaf in (CONV, RNN):
            if n[leaf] == "tf32":
                # the legacy setter writes 'none' (inherit); where the parent is 'tf32'
                # that would leak through, so the leaf gets an explicit 'ieee'
                n[leaf] = n[CUDA] if n[CUDA] != "tf32" else "ieee"
        nodes = tuple(n)
    return (enabled, enabled, precision, nodes)


_ONEDNN_FOR_PRECISION = {"highest": "ieee", "high": "tf32", "medium": "bf16"}
_IEEE = ("none", "ieee")  # resolved values that mean full fp32 ('none': nobody set it)


def precision_target(state: FamilyState, precision: str) -> FamilyState:
    """The state ``torch.set_float32_matmul_precision(precision)`` would produce from ``state``.

    Returns ``state`` itself when the precision already holds (for 'medium': only when
    oneDNN matmul is really on bf16, since that is what 'medium' changes on a CPU; for
    'highest': only when cuBLAS is really on IEEE, since a value the legacy API cannot see,
    such as 2.15's 'bfx9', also reads 'highest').
    """
    nodes = state[F_NODES]
    if state[F_PRECISION] == precision and (
        nodes is None
        or precision == "high"
        or (precision == "medium" and nodes[MKLDNN_MATMUL] == "bf16")
        or (precision == "highest" and nodes[MATMUL] in _IEEE)
    ):
        return state
    tf32 = precision != "highest"
    if nodes is not None:
        n = list(nodes)
        n[MATMUL] = "tf32" if tf32 else "ieee"
        if tf32 or n[MKLDNN_MATMUL] not in _IEEE:  # oneDNN already on fp32 stays as it is
            n[MKLDNN_MATMUL] = _ONEDNN_FOR_PRECISION[precision]
        nodes = tuple(n)
    return (tf32, state[F_CUDNN], precision, nodes)


def heal_target(state: FamilyState, prefer_cuda: bool) -> tuple[FamilyState, list[str]]:
    """A consistent state whose kernels see the same precision as ``state``'s new-API values.

    Kernels read the new API's resolved values, so those are kept and the legacy scalars
    follow them. Where no legacy value can express them (cuBLAS not TF32 while oneDNN matmul
    is bf16; cuDNN conv and rnn disagreeing) one side gives way, and a note says which.
    """
    notes: list[str] = []
    nodes = state[F_NODES]
    if nodes is None:
        return state, notes
    n = list(nodes)
    mm_tf32 = n[MATMUL] == "tf32"
    if n[MKLDNN_MATMUL] == "tf32" and not mm_tf32:
        # oneDNN TF32 is an Intel-GPU mode; no CPU kernel uses it, so dropping it changes nothing
        notes.append(f"{NODE_NAMES[MKLDNN_MATMUL]} 'tf32' -> 'ieee' (no CPU kernel uses it)")
        n[MKLDNN_MATMUL] = "ieee"
    if n[MKLDNN_MATMUL] == "bf16" and not mm_tf32:
        if prefer_cuda:
            notes.append(
                f"{NODE_NAMES[MKLDNN_MATMUL]} 'bf16' -> 'ieee': the legacy API cannot express "
                "cuBLAS without TF32 together with oneDNN bf16, and the CUDA kernels were kept"
            )
            n[MKLDNN_MATMUL] = "ieee"
        else:
            notes.append(
                f"{NODE_NAMES[MATMUL]} {n[MATMUL]!r} -> 'tf32': the legacy API cannot express "
                "oneDNN bf16 without cuBLAS TF32; no CUDA device is available, so the CPU "
                "kernels were kept"
            )
            n[MATMUL] = "tf32"
            mm_tf32 = True
    if n[MKLDNN_MATMUL] == "bf16":
        precision = "medium"
    elif mm_tf32:
        precision = "high"
    else:
        precision = "highest"
    conv_tf32 = n[CONV] == "tf32"
    if (n[RNN] == "tf32") != conv_tf32:
        new_rnn = "tf32" if conv_tf32 else (n[CUDA] if n[CUDA] != "tf32" else "ieee")
        notes.append(
            f"{NODE_NAMES[RNN]} {n[RNN]!r} -> {new_rnn!r}: the legacy {LEGACY_CUDNN} is one "
            "flag for conv and rnn, and convolutions were kept"
        )
        n[RNN] = new_rnn
    return (mm_tf32, conv_tf32, precision, tuple(n)), notes


# --- writing ---------------------------------------------------------------------------------


class WritePlan(NamedTuple):
    """The setter calls that take one state to another, and what they leave behind."""

    # (legacy setter name for the warn-once guard, or "" for a new-API node write, fn, args)
    ops: Tuple[Tuple[str, Callable[..., Any], Tuple[Any, ...]], ...]
    predicted: Optional[Tuple[str, ...]]  # resolved nodes after the ops
    written: Tuple[int, ...]  # nodes to read back


# Plans depend only on (current, target), and a training loop makes the same few transitions
# every step, so they are computed once. The first run of a plan is checked against a read of
# everything it wrote; a plan that reached its target once is trusted after that (PyTorch's
# setters do not change behaviour within a process), which keeps enter/exit cheap. Frames
# still read the whole family on entry and exit, so anything else that changed is seen.
# Bounded: cleared when full.
_PLANS: dict[tuple[FamilyState, FamilyState], Optional[WritePlan]] = {}
# (current, target) -> the plan's setter calls, once the plan has reached its target
_TRUSTED: dict[
    tuple[FamilyState, FamilyState], Tuple[Tuple[Callable[..., Any], Tuple[Any, ...]], ...]
] = {}
# lever request -> (target, setter calls): one dict lookup per lever write on the hot path
_FAST: dict[
    Hashable, tuple[FamilyState, Tuple[Tuple[Callable[..., Any], Tuple[Any, ...]], ...]]
] = {}
_MAX_PLANS = 512


def _plan_write(current: FamilyState, target: FamilyState) -> Optional[WritePlan]:
    """Plan ``current`` -> ``target``; None when a parent node must change (no fast plan).

    Legacy setters go first (they keep both views in step), then the leaves are corrected
    through the new API: 'none' (inherit) where the parent already resolves to the wanted
    value, an explicit value where a parent would leak through. Which leaves each legacy
    setter writes is known (research/tf32_api.md), so no read is needed in between.
    """
    tnodes = target[F_NODES]
    cnodes = current[F_NODES]
    if (
        tnodes is not None
        and cnodes is not None
        and (
            cnodes[GENERIC] != tnodes[GENERIC]
            or cnodes[CUDA] != tnodes[CUDA]
            or cnodes[MKLDNN] != tnodes[MKLDNN]
        )
    ):
        return None
    ops: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = []
    predicted = list(cnodes) if cnodes is not None else None
    written: list[int] = []
    # The legacy matmul scalar. It also writes the cuBLAS leaf; set_float32_matmul_precision
    # writes the oneDNN matmul leaf too, so the lighter allow_tf32 setter is used when enough.
    precision = target[F_PRECISION]
    if current[F_PRECISION] != precision or current[F_MATMUL] != target[F_MATMUL]:
        if (
            precision in ("highest", "high")
            and current[F_PRECISION] in ("highest", "high")
            and (
                predicted is None
                or tnodes is None
                or predicted[MKLDNN_MATMUL] == tnodes[MKLDNN_MATMUL]
            )
        ):
            ops.append(("set_cublas", _set_cublas, (precision == "high",)))
            if predicted is not None:
                predicted[MATMUL] = "tf32" if precision == "high" else "ieee"
                written.append(MATMUL)
        else:
            ops.append(("set_precision", _set_precision, (precision,)))
            if predicted is not None:
                predicted[MATMUL] = "ieee" if precision == "highest" else "tf32"
                predicted[MKLDNN_MATMUL] = _ONEDNN_FOR_PRECISION[str(precision)]
                written += (MATMUL, MKLDNN_MATMUL)
    # The legacy cuDNN scalar: conv and rnn become explicit 'tf32', or 'none' (inherit).
    if current[F_CUDNN] != target[F_CUDNN]:
        ops.append(("set_cudnn", _set_cudnn, (target[F_CUDNN],)))
        if predicted is not None:
            predicted[CONV] = predicted[RNN] = "tf32" if target[F_CUDNN] else predicted[CUDA]
            written += (CONV, RNN)
    if predicted is not None and tnodes is not None:
        for leaf, parent in LEAVES:
            want = tnodes[leaf]
            if predicted[leaf] != want:
                ops.append(
                    ("", _set_node, (*NODES[leaf], "none" if predicted[parent] == want else want))
                )
                predicted[leaf] = want
                written.append(leaf)
    return WritePlan(
        tuple(ops),
        tuple(predicted) if predicted is not None else None,
        tuple(sorted(set(written))),
    )


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
        plan = _plan_write(current, target)
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
    after: FamilyState = (*_read_legacy(), predicted)
    if after == target:
        _TRUSTED[key] = tuple((fn, args) for _, fn, args in plan.ops)
        return after
    return _write_slow(target, read_state())


def transition(
    request: Hashable,
    current: FamilyState,
    make_target: Callable[..., FamilyState],
    *args: Any,
) -> tuple[FamilyState, FamilyState]:
    """Write ``make_target(*args)`` over ``current``; return ``(state after, target)``.

    ``request`` must determine the target together with ``current`` (e.g.
    ``("tf32", current, True)``). Once a request has been written through a checked plan,
    it costs one dict lookup and its setter calls.
    """
    hit = _FAST.get(request)
    if hit is not None:
        target, ops = hit
        for fn, fn_args in ops:
            fn(*fn_args)
        return target, target
    target = make_target(*args)
    after = write_state(target, current)
    if after == target:
        written = () if current == target else _TRUSTED.get((current, target))
        if written is not None:
            _FAST[request] = (target, written)
    return after, target


def _run(ops: Tuple[Tuple[str, Callable[..., Any], Tuple[Any, ...]], ...]) -> None:
    for name, fn, args in ops:
        if name:
            _quiet_first(name, fn, *args)
        else:
            fn(*args)


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
    plan = _plan_write(current, target)
    if plan is not None:  # the legacy setters only; leaves are corrected from a fresh read
        _run(tuple(op for op in plan.ops if op[0]))
    after = read_state()
    if after != target and tnodes is not None and after[F_NODES] is not None:
        resolved = list(after[F_NODES])
        for leaf, parent in LEAVES:
            want = tnodes[leaf]
            if resolved[leaf] != want:
                _set_node(*NODES[leaf], "none" if resolved[parent] == want else want)
        after = read_state()
    return after


# --- describing ------------------------------------------------------------------------------


def describe_state(state: FamilyState) -> dict[str, Any]:
    """Every getter of both families by the name a user would type."""
    out: dict[str, Any] = {
        LEGACY_MATMUL: state[F_MATMUL],
        LEGACY_CUDNN: state[F_CUDNN],
        LEGACY_PRECISION: state[F_PRECISION],
    }
    if state[F_NODES] is not None:
        for name, value in zip(NODE_NAMES, state[F_NODES]):
            out[name] = value
    return out


def describe_precision(state: FamilyState) -> dict[str, Any]:
    """The getters ``matmul_precision`` is about."""
    out: dict[str, Any] = {LEGACY_PRECISION: state[F_PRECISION]}
    if state[F_NODES] is not None:
        out[NODE_NAMES[MATMUL]] = state[F_NODES][MATMUL]
        out[NODE_NAMES[MKLDNN_MATMUL]] = state[F_NODES][MKLDNN_MATMUL]
    return out
