"""oneDNN's route for ``matmul_precision="medium"`` on this CPU, found by trying.

``"medium"`` sends float32 CPU matmuls to oneDNN with bf16 fpmath, where the PyTorch has that
route (pytorch/pytorch#116015; PyTorch 2.1 has none: its result is bit-identical to
``"highest"``). What oneDNN computes then depends on the CPU: with AMX (Intel Xeon, Sapphire
Rapids and later) it rounds the inputs to bf16 and the error is bf16-level (about 3e-3);
without AMX (AMD Zen 3, 4 and 5, older Xeons) it keeps fp32 arithmetic and the error stays
fp32-level (about 1e-7), the gain being only the switch from MKL's kernel to oneDNN's.

The ``matmul_precision`` lever predicts this from PyTorch's oneDNN check and the CPU's flags
(the lever layer writes no torch state to find out). :func:`medium_route` runs the
``matmul_precision`` probe once per process and keeps the answer, and :func:`effect_here`
puts it in place of the prediction: ``verify``, ``bench`` and ``tune`` read their levers'
effects through it. Tests whose expectation depends on the route ask it too (and fake it
through :data:`_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._hardware import cpu_features
from .._locks import new_lock
from ..levers import Effect
from ..levers.registry import lever_spec
from . import probes

__all__ = ["MediumRoute", "effect_here", "medium_route"]

_CPU = torch.device("cpu")
NO_EFFECT_ON_CPU = "no effect on cpu: "


@dataclass(frozen=True)
class MediumRoute:
    """What ``matmul_precision="medium"`` does to float32 matmuls on this CPU.

    Attributes:
        arithmetic: ``"bf16"`` (oneDNN's bf16 fpmath: AMX), ``"fp32"`` (oneDNN's kernel,
            fp32 arithmetic: no AMX) or ``"none"`` (the same kernel as ``"highest"``).
        reason: what that means, in words.
        measured: the errors measured (empty where nothing was).

    Example:
        >>> from speedflags._measure.route import MediumRoute
        >>> route = MediumRoute("fp32", "oneDNN keeps fp32 arithmetic on this CPU (no AMX)")
        >>> route.bf16, route.effective
        (False, True)
    """

    arithmetic: str
    reason: str
    measured: str = ""

    @property
    def bf16(self) -> bool:
        """Whether the error is bf16-level (oneDNN computes in bf16)."""
        return self.arithmetic == "bf16"

    @property
    def effective(self) -> bool:
        """Whether ``"medium"`` changes the kernel at all."""
        return self.arithmetic != "none"


def try_medium_route() -> MediumRoute:
    """Run a float32 matmul under ``"highest"`` and ``"medium"`` now (uncached).

    Example:
        >>> from speedflags._measure.route import try_medium_route
        >>> try_medium_route().arithmetic in ("bf16", "fp32", "none")
        True
    """
    effect = lever_spec("matmul_precision").lever("cpu").available("medium", _CPU)
    if not effect.effective:  # the reason in words of its own: effect_here says "no effect"
        return MediumRoute("none", effect.reason.removeprefix(NO_EFFECT_ON_CPU))
    if not _onednn_enabled():
        return MediumRoute("none", "oneDNN is disabled (torch.backends.mkldnn.enabled is False)")
    ctx = probes.Context(_CPU)
    try:
        probes.baseline(ctx)
        obs = probes.matmul_precision(ctx, "medium")
    except Exception as exc:  # a frame refused (a mixed TF32 state): say so, keep nothing
        return MediumRoute("none", f"could not try 'medium': {type(exc).__name__}: {exc}")
    assert obs is not None  # noqa: S101 - the probe measures on every device type
    error = obs.measured["matmul_error"]
    highest = ctx.baseline.measured["matmul_error"] if ctx.baseline else float("nan")
    measured = f"a float32 matmul's error is {error:.1e} ('highest': {highest:.1e})"
    amx = cpu_features().amx_bf16
    if obs.measured["arithmetic"] == "bf16":
        where = "AMX" if amx else "the CPU's flags list no AMX"
        return MediumRoute("bf16", f"oneDNN computes in bf16 on this CPU ({where})", measured)
    if obs.measured["bit_identical_to_highest"]:
        why = (
            f"PyTorch {torch.__version__} has no oneDNN route for 'medium': float32 CPU matmuls "
            "run on the same kernel as under 'highest' (bit-identical results)"
        )
        return MediumRoute("none", why, measured)
    where = "although the CPU's flags list AMX" if amx else "no AMX"
    return MediumRoute("fp32", f"oneDNN keeps fp32 arithmetic on this CPU ({where})", measured)


def _onednn_enabled() -> bool:
    mkldnn: Any = torch.backends.mkldnn  # typed Any: its flag is a ContextProp in the stubs
    return bool(mkldnn.enabled)


_cache: dict[str, MediumRoute] = {}  # "cpu" -> the answer; tests fake it with setitem
_lock = new_lock()


def medium_route() -> MediumRoute:
    """What ``matmul_precision="medium"`` does to float32 CPU matmuls here (tried once).

    Found by trying once per process, then kept (an answer found while oneDNN was disabled,
    or a trial that failed, is not kept).

    Scope: the trial opens two ``fast_math`` frames on top of the baseline (process-wide
    levers, the calling thread's autocast); each restores every flag on exit.

    Example:
        >>> from speedflags._measure.route import medium_route
        >>> route = medium_route()
        >>> route is medium_route(), route.arithmetic in ("bf16", "fp32", "none")
        (True, True)
    """
    found = _cache.get("cpu")
    if found is None:
        with _lock:
            found = _cache.get("cpu")
            if found is None:
                found = try_medium_route()
                kept = _onednn_enabled() and not found.reason.startswith("could not")
                if kept:
                    _cache["cpu"] = found
    return found


def effect_here(name: str, value: Any, device: torch.device) -> Effect:
    """``name=value``'s effect on ``device``: the lever's answer, corrected by trying.

    ``value`` is a validated value. The lever's own ``available()`` answers everywhere but
    for ``matmul_precision="medium"`` on a CPU, where :func:`medium_route`'s measurement
    replaces the prediction (no effect where this PyTorch has no oneDNN route).

    Example:
        >>> import torch
        >>> from speedflags._measure.route import effect_here
        >>> effect_here("tf32", True, torch.device("cpu")).effective
        False
    """
    effect = lever_spec(name).effect(value, device)
    if name != "matmul_precision" or value != "medium" or device.type != "cpu":
        return effect
    if not effect.effective:
        return effect
    route = medium_route()
    if not route.effective:
        return Effect(False, f"{NO_EFFECT_ON_CPU}{route.reason}")
    return Effect(True, f"routes float32 CPU matmuls through oneDNN; {route.reason}")
