"""Looking at the flags without changing them, and repairing a mixed TF32 state.

``snapshot()`` and ``tf32_status()`` only read (and never raise); ``heal_tf32()`` writes,
through the ledger's lock, and records what it did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ._ledger.decorate import caller_where
from ._ledger.ledger import ledger
from ._short_repr import set_module
from ._watch.watcher import tf32_writer
from .errors import StateMismatchError
from .levers import _fp32_model as family
from .levers import _fp32_torch as family_io
from .levers._fp32_mixed import conflicts, heal_target
from .levers.guarded import guarded_snapshot
from .levers.lever_sets import lever_snapshot
from .levers.registry import lever_spec

__all__ = ["TF32Status", "heal_tf32", "snapshot", "tf32_status"]

ENV_OVERRIDES = ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
AUTOCAST_DEVICES = ("cpu", "cuda")


def snapshot() -> dict[str, Any]:
    """Every lever's current observable state, by lever name, and every guarded setting's
    (``default_dtype``, ``grad_enabled``, ...: torch state that changes numerics or kernels,
    which speedflags watches but does not set; see ``docs/guarded.md``). Never raises.

    A PyTorch getter that would raise (a legacy TF32 getter in a mixed state) is reported
    as an :class:`~speedflags.Unreadable` value, which says so and compares equal to the
    same failure. ``amp`` and the thread-scope settings are the calling thread's.

    Example:
        >>> import speedflags
        >>> before = speedflags.snapshot()
        >>> with speedflags.fast_math(tf32=True):
        ...     speedflags.snapshot()["tf32"]["torch.backends.cuda.matmul.allow_tf32"]
        True
        >>> speedflags.snapshot() == before
        True
    """
    return {**lever_snapshot(AUTOCAST_DEVICES), **guarded_snapshot()}


@set_module("speedflags")
@dataclass(frozen=True)
class TF32Status:
    """Both TF32 API families, side by side (see :func:`tf32_status`).

    Attributes:
        api: ``"legacy"`` (PyTorch before 2.9) or ``"legacy+fp32_precision"``.
        consistent: no legacy getter raises (PyTorch's compile paths are safe).
        legacy: the legacy getters, each a value or an ``Unreadable``.
        new: the ``fp32_precision`` getters (``None`` before PyTorch 2.9).
        effective: what kernels use now: TF32 for cuBLAS matmul, cuDNN conv, cuDNN rnn, and
            bf16 for oneDNN (CPU) matmul.
        conflicts: one sentence per disagreement between the families.
        env: the environment overrides and their values (``None`` when unset).
        notes: what the environment overrides and the state mean, in words.
        last_written_by: who wrote the state as it is now (when mixed: who made it mixed),
            e.g. ``"torch.backends.fp32_precision set to 'tf32' by enable_tf32 at
            .../import_utils.py:756"``; ``None`` when unknown (known only for writes made
            through Python while :func:`speedflags.watch` was on).

    Example:
        >>> import speedflags
        >>> status = speedflags.tf32_status()
        >>> status.consistent, status.api in ("legacy", "legacy+fp32_precision")
        (True, True)
    """

    api: str
    consistent: bool
    legacy: dict[str, Any]
    new: dict[str, str] | None
    effective: dict[str, bool]
    conflicts: tuple[str, ...]
    env: dict[str, str | None]
    notes: tuple[str, ...] = field(default=())
    last_written_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (tuples as lists)."""
        return {
            f.name: list(value) if isinstance(value, tuple) else value
            for f in fields(self)
            for value in (getattr(self, f.name),)
        }


def _status(state: family.FamilyState, extra_notes: tuple[str, ...] = ()) -> TF32Status:
    described = family.describe_state(state)
    legacy = {
        k: described[k]
        for k in (family.LEGACY_MATMUL, family.LEGACY_CUDNN, family.LEGACY_PRECISION)
    }
    nodes = state[family.F_NODES]
    if nodes is not None:
        new: dict[str, str] | None = dict(zip(family.NODE_NAMES, nodes, strict=True))
        effective = {
            "cublas_matmul_tf32": nodes[family.MATMUL] == "tf32",
            "cudnn_conv_tf32": nodes[family.CONV] == "tf32",
            "cudnn_rnn_tf32": nodes[family.RNN] == "tf32",
            "onednn_matmul_bf16": nodes[family.MKLDNN_MATMUL] == "bf16",
        }
    else:
        new = None
        effective = {
            "cublas_matmul_tf32": state[family.F_MATMUL] is True,
            "cudnn_conv_tf32": state[family.F_CUDNN] is True,
            "cudnn_rnn_tf32": state[family.F_CUDNN] is True,
            "onednn_matmul_bf16": state[family.F_PRECISION] == "medium",
        }
    env = {name: os.environ.get(name) for name in ENV_OVERRIDES}
    notes = list(extra_notes)
    if nodes is not None and nodes[family.MATMUL] not in ("none", "ieee", "tf32"):
        notes.append(
            f"{family.NODE_NAMES[family.MATMUL]} is {nodes[family.MATMUL]!r}: cuBLAS float32 "
            "matmuls use that mode, which is not TF32; the legacy getters cannot show it "
            f"({family.LEGACY_MATMUL} reads False when consistent)"
        )
    if env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] == "1":
        notes.append(
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 switched cuBLAS TF32 on at startup (the getters "
            "show it)"
        )
    if env["NVIDIA_TF32_OVERRIDE"] == "0":
        notes.append(
            "NVIDIA_TF32_OVERRIDE=0 disables TF32 inside the CUDA libraries whatever the flags "
            "say; PyTorch's getters cannot see it"
        )
    writer = tf32_writer(state)
    if writer is not None and not family.is_consistent(state):
        notes.append(f"made mixed by: {writer.sentence()}")
    return TF32Status(
        api="legacy+fp32_precision" if family_io.HAS_NEW_API else "legacy",
        consistent=family.is_consistent(state),
        legacy=legacy,
        new=new,
        effective=effective,
        conflicts=tuple(conflicts(state)),
        env=env,
        notes=tuple(notes),
        last_written_by=writer.sentence() if writer is not None else None,
    )


def tf32_status() -> TF32Status:
    """Both TF32 API families, whether they agree, and the environment overrides. Never raises.

    Example:
        >>> import speedflags
        >>> status = speedflags.tf32_status()
        >>> status.consistent
        True
        >>> sorted(status.env)
        ['NVIDIA_TF32_OVERRIDE', 'TORCH_ALLOW_TF32_CUBLAS_OVERRIDE']
    """
    return _status(family_io.read_state())


def heal_tf32() -> TF32Status:
    """Make a mixed TF32 state consistent, keeping the precision kernels use now.

    Kernels read the new ``fp32_precision`` API, so its values are kept and the legacy
    flags are set to agree with them. Where no legacy value can express the current state
    (cuBLAS without TF32 but oneDNN matmul in bf16; cuDNN conv and rnn disagreeing), one side
    gives way and the returned status's ``notes`` (and the ledger record) say which.

    Scope: process. Permanent: it is a repair, not a block, so nothing is restored later.
    Recorded on the ledger as action ``"heal"``.

    Returns:
        The :class:`TF32Status` after healing.

    Example:
        >>> import torch, speedflags
        >>> two_families = speedflags.tf32_status().api != "legacy"  # PyTorch 2.9+
        >>> if two_families:  # a legacy-only PyTorch cannot be mixed
        ...     torch.backends.cuda.matmul.fp32_precision = "tf32"  # new API only: now mixed
        >>> speedflags.tf32_status().consistent == (not two_families)
        True
        >>> speedflags.heal_tf32().consistent
        True
        >>> torch.backends.cuda.matmul.allow_tf32 == two_families  # kept what kernels used
        True
        >>> with speedflags.tf32(False):  # speedflags is usable again
        ...     torch.backends.cuda.matmul.allow_tf32
        False
        >>> torch.backends.cuda.matmul.allow_tf32 = False  # tidy up: back to a fresh process
        >>> if two_families:
        ...     torch.backends.cuda.matmul.fp32_precision = "none"
    """
    the_ledger = ledger()
    where = caller_where(2)
    tf32_lever = lever_spec("tf32").lever()
    # the lock: no frame may open or close while the family is rewritten; the section:
    # speedflags.watch() takes these writes as speedflags' own
    with the_ledger.lock, the_ledger.section("heal_tf32()", where):
        before = family_io.read_state()
        notes: list[str] = []
        after = before
        if not family.is_consistent(before):
            target, notes = heal_target(before, prefer_cuda=torch.cuda.is_available())
            after = family_io.write_state(target, before)
            if after != target:
                raise StateMismatchError(
                    f"heal_tf32: wrote {family.describe_state(target)!r} but PyTorch "
                    f"{torch.__version__} reports {family.describe_state(after)!r}"
                )
    if after is before:
        reason = "already consistent: nothing written"
    else:
        reason = "; ".join(notes) or "the legacy flags now agree with the new API"
    the_ledger.note(
        "tf32",
        "heal",
        reason,
        before=tf32_lever.describe(before),
        after=tf32_lever.describe(after),
        label="heal_tf32()",
        where=where,
    )
    return _status(after, tuple(notes))
