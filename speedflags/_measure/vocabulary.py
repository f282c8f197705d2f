"""The words every tool says what a lever does on a device with: one vocabulary of verdicts.

``speedflags report``, ``verify``, ``bench`` and ``tune`` (and the examples) say the same
thing the same way: a lever is *in effect* (``verify``: *verified*, measured), has *no effect
here* (a TF32 flag on a CPU), is *in effect, emulated: slower* (bf16 or fp16 autocast on a
CPU without the instructions for the dtype: it computes in the dtype, at a fraction of the
speed; with the measured factor where one was measured), or is *refused by this PyTorch*
(a value the installed PyTorch raises for, fp16 CPU autocast on PyTorch 2.1). ``verify``
adds what only a measurement can say: *requested but not in effect* and *could not be
measured*.

:func:`status_of` turns a lever's :class:`~speedflags.levers.Effect` into its word;
:func:`phrase` puts a word before its reason without saying "no effect" twice;
:func:`verdicts_here` gives each value of a set of levers its word on a device, and
:func:`nothing_changes` says whether none of them changes anything there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .._fast_math import resolve_auto
from ..levers import Effect
from ..levers.autocast import AUTO
from ..levers.registry import check_levers
from .route import effect_here

__all__ = [
    "EMULATED",
    "IN_EFFECT",
    "NOT_IN_EFFECT",
    "NO_EFFECT",
    "REFUSED",
    "UNMEASURED",
    "VERIFIED",
    "LeverVerdict",
    "nothing_changes",
    "phrase",
    "slower",
    "status_of",
    "verdicts_here",
]

VERIFIED = "verified"  # measured in effect (verify)
IN_EFFECT = "in effect"  # in effect by the device's answers (not measured)
EMULATED = "in effect, emulated: slower"  # it computes in the dtype, slower than without it
NO_EFFECT = "no effect here"  # the device has nothing it changes (TF32 on a CPU)
REFUSED = "refused by this PyTorch"  # the installed PyTorch raises for it here: never applied
NOT_IN_EFFECT = "requested but not in effect"  # verify: the flags say on, the measure says off
UNMEASURED = "could not be measured"  # verify: the probe failed


def status_of(effect: Effect) -> str:
    """The word for what a lever value does on a device, from its ``Effect``.

    Example:
        >>> from speedflags.levers import Effect
        >>> from speedflags._measure.vocabulary import status_of
        >>> status_of(Effect(True, "")), status_of(Effect(False, "no effect on cpu: no GPU"))
        ('in effect', 'no effect here')
        >>> status_of(Effect(False, "bf16 runs emulated on this CPU", slow=True))
        'in effect, emulated: slower'
    """
    if effect.unsupported:
        return REFUSED
    if effect.slow:
        return EMULATED
    return IN_EFFECT if effect.effective else NO_EFFECT


def phrase(status: str, reason: str) -> str:
    """``status: reason`` in one line, without repeating "no effect" where the reason says it.

    Example:
        >>> from speedflags._measure.vocabulary import NO_EFFECT, REFUSED, phrase
        >>> phrase(NO_EFFECT, "no effect on cpu: TF32 needs an NVIDIA GPU")
        'no effect on cpu: TF32 needs an NVIDIA GPU'
        >>> phrase(REFUSED, "PyTorch 2.1.2's CPU autocast runs bf16 only")
        "refused by this PyTorch: PyTorch 2.1.2's CPU autocast runs bf16 only"
    """
    if not reason:
        return status
    if status == NO_EFFECT and reason.startswith("no effect"):
        return reason
    return f"{status}: {reason}"


def slower(factor: float, how: str) -> str:
    """A measured slowdown in words: ``factor`` is the baseline's time over the lever's.

    Example:
        >>> from speedflags._measure.vocabulary import slower
        >>> slower(0.021, "a 256x256 matmul, 5 interleaved rounds")
        '48x slower than without it (a 256x256 matmul, 5 interleaved rounds)'
    """
    if not math.isfinite(factor) or factor <= 0:
        return f"slower than without it ({how})"
    if factor >= 1.0:
        return f"not slower here: {factor:.2f}x ({how})"
    times = 1.0 / factor
    shown = f"{times:.0f}" if times >= 10 else f"{times:.1f}"
    return f"{shown}x slower than without it ({how})"


class LeverVerdict(NamedTuple):
    """One lever value's word on a device, and the reason (empty when in effect plainly)."""

    lever: str
    value: Any
    status: str
    reason: str

    @property
    def label(self) -> str:
        """The lever value as a user writes it: ``amp='bf16'``."""
        return f"{self.lever}={self.value!r}"


def verdicts_here(levers: Mapping[str, Any], device: torch.device | str) -> list[LeverVerdict]:
    """Each of ``levers`` (``fast_math`` keywords) with its word on ``device``.

    The levers' own answers (``Lever.available``), with ``matmul_precision="medium"`` on a
    CPU as found by trying (:func:`~speedflags._measure.route.effect_here`). Nothing is
    timed; ``verify`` measures.

    Example:
        >>> from speedflags._measure.vocabulary import verdicts_here
        >>> [(v.label, v.status) for v in verdicts_here({"tf32": True}, "cpu")]
        [('tf32=True', 'no effect here')]
        >>> import speedflags
        >>> (auto,) = verdicts_here({"amp": "auto"}, "cpu")  # the dtype "auto" picks here
        >>> (auto.status == "in effect") == bool(speedflags.capabilities("cpu").bf16)
        True
    """
    target = torch.device(device)
    out = []
    for name, value in check_levers("verdicts_here", dict(levers)):
        given = levers[name]  # as the user wrote it
        if value == AUTO:  # amp="auto": the dtype it picks here, or none
            value, why = resolve_auto(target)
            if value is None:
                out.append(LeverVerdict(name, given, NO_EFFECT, why))
                continue
        effect = effect_here(name, value, target)
        out.append(LeverVerdict(name, given, status_of(effect), effect.reason))
    return out


def nothing_changes(verdicts: list[LeverVerdict]) -> bool:
    """Whether none of ``verdicts`` changes anything on the device (all "no effect here").

    Example:
        >>> from speedflags._measure.vocabulary import nothing_changes, verdicts_here
        >>> nothing_changes(verdicts_here({"cudnn_benchmark": True}, "cpu"))
        True
    """
    return all(v.status == NO_EFFECT for v in verdicts)
