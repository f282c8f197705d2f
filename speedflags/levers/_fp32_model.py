"""A pure model of PyTorch's fp32-precision family: the legacy TF32 API and the 2.9+ tree.

No torch here: given a state (what every getter of both API families answers) and a target
(``tf32`` on or off, a matmul precision, a state to restore), this module works out the
state wanted and the setter calls that reach it. :mod:`._fp32_torch` reads the getters,
runs the calls and checks the result. ``docs/tf32_policy.md`` has the measured rules:

1. PyTorch's legacy *getters* raise ``RuntimeError("... mix of the legacy and new APIs ...")``
   whenever the two families disagree, and PyTorch's own compile/autotune/benchmark paths
   call them, so only states that both families can read are ever written (targets are
   consistent; a mixed starting state is refused, or healed on request: :mod:`._fp32_mixed`).
2. Legacy setters first (they update both views); then new-API corrections of the leaf
   nodes, putting ``'none'`` (inherit) back where the parent already resolves to the wanted
   value and an explicit value where a parent would leak through.

Two things no API can restore (documented for users in docs/guarantees.md): cuDNN conv/rnn start
at a hidden ``DEFAULT`` that cannot be written back, and an inherited value cannot be told
from an explicit one through the getters.

Versions (tested on 2.4.1, 2.13 and 2.15):

- Before 2.9 there is no tree: ``state[F_NODES]`` is None, and targets and plans use the
  three legacy scalars alone.
- 2.15 repeats every measured rule, with two changes. ``cuda.matmul`` (and no other node)
  also accepts ``'bfx9'``, cuBLAS's BF16x9 emulation of fp32. The legacy getters see it as
  not-TF32 (``allow_tf32`` False, precision 'highest') and raise when it meets a legacy
  'high' or 'medium'. Node values are opaque strings here, so 'bfx9' is read, refused when
  mixed, healed and restored like any other value; ``tf32=False`` keeps it (it is not TF32)
  and ``matmul_precision='highest'`` replaces it with 'ieee', as
  ``torch.set_float32_matmul_precision('highest')`` does. And most of PyTorch's compile-path
  readers moved to the new API's getters (pytorch#196860), so a mixed state breaks fewer of
  them; inductor's bmm and conv templates still read the legacy ``allow_tf32``, so the
  never-mixed policy stays as it is.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from ._base import Unreadable

# The nine nodes of the fp32_precision tree, as (backend, op) pairs.
NODES: tuple[tuple[str, str], ...] = (
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
PARENT: tuple[int | None, ...] = (
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
LEAVES: tuple[tuple[int, int], ...] = (
    (MATMUL, CUDA),
    (CONV, CUDA),
    (RNN, CUDA),
    (MKLDNN_MATMUL, MKLDNN),
    (MKLDNN_CONV, MKLDNN),
    (MKLDNN_RNN, MKLDNN),
)

# How users see each node: the attribute that reads it.
NODE_NAMES: tuple[str, ...] = (
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

# Every getter of both families: (torch.backends.cuda.matmul.allow_tf32,
# torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(), resolved
# fp32_precision per NODES or None before 2.9); legacy values are Unreadable when they raise.
# An exact tuple of atomic values, not a NamedTuple: the ledger's bounded history holds
# thousands of these, and the garbage collector can stop tracking exact tuples of atomic
# values but never a tuple subclass (measured: ~23% of a frame's cost was GC traversal).
FamilyState = tuple[Any, Any, Any, tuple[str, ...] | None]
F_MATMUL: Final = 0
F_CUDNN: Final = 1
F_PRECISION: Final = 2
F_NODES: Final = 3

# The setters a plan calls, by name; the torch side maps each name to PyTorch's function.
SET_CUBLAS: Final = "set_cublas"  # torch.backends.cuda.matmul.allow_tf32 = flag
SET_PRECISION: Final = "set_precision"  # torch.set_float32_matmul_precision(precision)
SET_CUDNN: Final = "set_cudnn"  # torch.backends.cudnn.allow_tf32 = flag
SET_NODE: Final = "set_node"  # one fp32_precision node: (backend, op, value)
Op = tuple[str, tuple[Any, ...]]


def is_consistent(state: FamilyState) -> bool:
    """True when every legacy getter answers (none would raise the mixed-API error)."""
    return not (
        isinstance(state[F_MATMUL], Unreadable)
        or isinstance(state[F_CUDNN], Unreadable)
        or isinstance(state[F_PRECISION], Unreadable)
    )


# --- targets ---------------------------------------------------------------------------------

# A frame asks for the same few targets every step; bounded: cleared when full.
_TARGETS: dict[tuple[Any, ...], FamilyState] = {}
_MAX_TARGETS = 512


def tf32_target(state: FamilyState, enabled: bool) -> FamilyState:
    """The state ``tf32=enabled`` asks for from ``state`` (memoized: a pure function).

    On: cuBLAS matmul and cuDNN conv/rnn in TF32; the legacy precision becomes 'high' unless
    it already allows TF32 ('high' or 'medium', kept). Off: full fp32 everywhere the legacy
    API can see, i.e. precision 'highest', which also takes oneDNN matmul off bf16/tf32.
    A cuBLAS mode that is not TF32 and that the legacy API cannot see (2.15's 'bfx9') is
    kept by ``tf32=False``; ``matmul_precision='highest'`` replaces it with 'ieee'.
    """
    key = ("tf32", state, enabled)
    target = _TARGETS.get(key)
    if target is None:
        if len(_TARGETS) >= _MAX_TARGETS:
            _TARGETS.clear()
        target = _TARGETS[key] = _tf32_target(state, enabled)
    return target


def _tf32_target(state: FamilyState, enabled: bool) -> FamilyState:
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


# --- planning the writes ---------------------------------------------------------------------


class WritePlan(NamedTuple):
    """The setter calls that take one state to another, and what they leave behind."""

    ops: tuple[Op, ...]  # (setter name, args), in order
    predicted: tuple[str, ...] | None  # resolved nodes after the ops; None before 2.9
    written: tuple[int, ...]  # nodes the ops wrote, to read back


def node_value(want: str, parent_resolved: str) -> str:
    """What to write to a node so that it resolves to ``want``: 'none' (inherit) when the
    parent already resolves to it, which keeps the tree as a fresh process would have it."""
    return "none" if parent_resolved == want else want


def plan_write(current: FamilyState, target: FamilyState) -> WritePlan | None:
    """Plan ``current`` -> ``target``; None when a parent node must change (no fast plan).

    Legacy setters go first (they keep both views in step), then the leaves are corrected
    through the new API: 'none' (inherit) where the parent already resolves to the wanted
    value, an explicit value where a parent would leak through. Which leaves each legacy
    setter writes is known (docs/tf32_policy.md), so no read is needed in between.
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
    ops: list[Op] = []
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
            ops.append((SET_CUBLAS, (precision == "high",)))
            if predicted is not None:
                predicted[MATMUL] = "tf32" if precision == "high" else "ieee"
                written.append(MATMUL)
        else:
            ops.append((SET_PRECISION, (precision,)))
            if predicted is not None:
                predicted[MATMUL] = "ieee" if precision == "highest" else "tf32"
                predicted[MKLDNN_MATMUL] = _ONEDNN_FOR_PRECISION[str(precision)]
                written += (MATMUL, MKLDNN_MATMUL)
    # The legacy cuDNN scalar: conv and rnn become explicit 'tf32', or 'none' (inherit).
    if current[F_CUDNN] != target[F_CUDNN]:
        ops.append((SET_CUDNN, (target[F_CUDNN],)))
        if predicted is not None:
            predicted[CONV] = predicted[RNN] = "tf32" if target[F_CUDNN] else predicted[CUDA]
            written += (CONV, RNN)
    if predicted is not None and tnodes is not None:
        for leaf, parent in LEAVES:
            want = tnodes[leaf]
            if predicted[leaf] != want:
                ops.append((SET_NODE, (*NODES[leaf], node_value(want, predicted[parent]))))
                predicted[leaf] = want
                written.append(leaf)
    return WritePlan(
        tuple(ops),
        tuple(predicted) if predicted is not None else None,
        tuple(sorted(set(written))),
    )


# --- describing ------------------------------------------------------------------------------


def describe_state(state: FamilyState) -> dict[str, Any]:
    """Every getter of both families by the name a user would type."""
    out: dict[str, Any] = {
        LEGACY_MATMUL: state[F_MATMUL],
        LEGACY_CUDNN: state[F_CUDNN],
        LEGACY_PRECISION: state[F_PRECISION],
    }
    if state[F_NODES] is not None:
        for name, value in zip(NODE_NAMES, state[F_NODES], strict=True):
            out[name] = value
    return out


def describe_precision(state: FamilyState) -> dict[str, Any]:
    """The getters ``matmul_precision`` is about."""
    out: dict[str, Any] = {LEGACY_PRECISION: state[F_PRECISION]}
    if state[F_NODES] is not None:
        out[NODE_NAMES[MATMUL]] = state[F_NODES][MATMUL]
        out[NODE_NAMES[MKLDNN_MATMUL]] = state[F_NODES][MKLDNN_MATMUL]
    return out
