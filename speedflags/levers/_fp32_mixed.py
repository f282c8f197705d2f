"""Mixed states of the fp32-precision family: why one is mixed, refusing it, healing it.

Pure, like :mod:`._fp32_model`. A state is mixed when a legacy TF32 getter would raise
PyTorch's "mix of the legacy and new APIs" error (it reads as an ``Unreadable``). Writes
never start from a mixed state (:func:`require_consistent` refuses, naming each
disagreement); :func:`heal_target` is the consistent state that ``speedflags.heal_tf32()``
writes instead. The rules are in ``docs/tf32_policy.md``.
"""

from __future__ import annotations

from ..errors import MixedTF32APIError
from ._base import Unreadable
from ._fp32_model import (
    CONV,
    CUDA,
    F_CUDNN,
    F_MATMUL,
    F_NODES,
    F_PRECISION,
    LEGACY_CUDNN,
    LEGACY_MATMUL,
    MATMUL,
    MKLDNN_MATMUL,
    NODE_NAMES,
    PARENT,
    RNN,
    FamilyState,
    is_consistent,
)


def _inherited_note(nodes: tuple[str, ...], node: int) -> str:
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
    from .culprits import mixed_note  # local: a mixed state is rare

    details = conflicts(state) or ["a legacy TF32 getter raises"]
    raise MixedTF32APIError(
        f"refusing to {action}: PyTorch's legacy and new TF32 APIs disagree, so PyTorch's own "
        "compile and autotune paths would raise 'mix of the legacy and new APIs'. "
        + " ".join(f"{d}." for d in details)
        + " Nothing was changed. Fix: call speedflags.heal_tf32() to make both API families "
        "agree while keeping the precision kernels use now, then change TF32 only through "
        "speedflags (fast_math(tf32=...)) or through one API family." + mixed_note(state)
    )


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
