"""``speedflags.verify(device)``: enter each lever, measure that it took effect, give a verdict."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .._hardware import DeviceLike, capabilities, cudnn_version_or_none, resolve_device
from .._short_repr import short_repr
from .._status import snapshot
from .._warn import measuring
from ..errors import InvalidValueError
from ..levers import registry
from ..levers.registry import LeverSpec, lever_spec
from ..levers.sdpa import settle_first_call
from . import causes, probes
from .emulation import slowdown
from .lever_files import LeversArg, named_levers, plain_value
from .route import effect_here
from .verification import Verdict, Verification
from .vocabulary import (
    EMULATED,
    NO_EFFECT,
    NOT_IN_EFFECT,
    REFUSED,
    UNMEASURED,
    VERIFIED,
    slower,
)

__all__ = ["verify"]


def verify(device: DeviceLike = None, levers: LeversArg = None) -> Verification:
    """Enter each lever the device supports and measure that it took effect.

    For every lever of the registry and each value ``tune`` would try (``tf32=True``,
    ``matmul_precision="high"`` and ``"medium"``, ``cudnn_benchmark=True``, each fused SDPA
    kernel, ``reduced_precision_reduction=True``, bf16 and fp16 autocast), a small probe
    runs under ``fast_math`` on top of the baseline (every lever off) and measures: the
    error of a float32 matmul (and conv) against float64 for TF32 and matmul precision
    (TF32 about 3e-4, fp32 about 1e-7; on a CPU, ``"medium"`` by the oneDNN route's
    result), the output dtype and error level for autocast, the autotuner's trial kernels
    for cuDNN benchmark, the operator (and on CUDA the kernels) that ran for SDPA, whether
    long fp16/bf16 GEMMs differ from their fp32-reduction results (CUDA) for the
    reductions. The baseline itself is checked first: fp32 everywhere.

    Each value gets a :class:`~speedflags._measure.verification.Verdict`, in the words
    ``report``, ``bench`` and ``tune`` use (:mod:`speedflags._measure.vocabulary`):
    *verified* (with the figure), *in effect, emulated: slower* (bf16 or fp16 autocast on a
    CPU without the instructions: the figure, and how many times slower a small matmul ran,
    measured), *no effect here* (with the capability's reason), *refused by this PyTorch*
    (a value it raises for on the device, never applied), or *requested but not in effect*
    (with the cause found: ``NVIDIA_TF32_OVERRIDE=0``,
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, a mixed TF32 state, a disabled cuDNN or oneDNN,
    a kernel refusing the inputs). Takes seconds (a profiler start on CUDA).

    Args:
        device: the device to verify (default: CUDA if available, else CPU).
        levers: which levers: ``None`` for all, a name or list of names, or a dict of name
            to the values to verify (``{"amp": ["bf16"]}``).

    Returns:
        A :class:`Verification`; ``.ok`` is false when a lever is not in effect.

    Raises:
        InvalidValueError, InvalidTypeError: a bad ``device`` or ``levers`` (the message
            names the argument, the value and the valid choices), or CUDA asked for where
            there is none.

    Scope: every probe opens ``fast_math`` frames (process-wide levers, the calling thread's
    autocast) and each restores what it set on exit; ``verify`` checks afterwards that every
    flag reads as before (``restored``).

    Example:
        >>> import speedflags
        >>> run = speedflags.verify("cpu", levers=["tf32"])
        >>> [v.label for v in run.verdicts]
        ['baseline (every lever off)', 'tf32=True']
        >>> run.verdict("baseline").status, run.verdict("tf32").status, run.restored
        ('verified', 'no effect here', True)
    """
    started = time.perf_counter()
    target = resolve_device(device, "verify")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidValueError(f"verify(device={str(target)!r}): CUDA is not available here")
        index: int | None = target.index  # None for plain "cuda"
        if index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    wanted = _wanted(levers)
    ctx = probes.Context(target)  # on CUDA, in use from here (the probes' inputs)
    settle_first_call()  # PyTorch's own first SDPA call's write, before the state is read
    before = snapshot()
    with measuring():  # emulated levers are entered on purpose: their verdict says so
        verdicts = [_baseline(ctx)]
        for spec in registry.specs():
            for value in wanted.get(spec.name, ()):
                verdicts.append(_one(ctx, spec, value))
    changed = _changed(before, snapshot())
    return Verification(
        device=str(target),
        verdicts=verdicts,
        environment=environment(target),
        restored=not changed,
        unrestored=changed,
        elapsed_s=round(time.perf_counter() - started, 3),
    )


def _wanted(levers: LeversArg) -> dict[str, tuple[Any, ...]]:
    choices = ", ".join(registry.lever_names())
    if levers is None:
        return {spec.name: spec.candidates for spec in registry.specs()}
    items = named_levers("verify", levers, choices)
    out: dict[str, tuple[Any, ...]] = {}
    for name, values in items:
        if not isinstance(name, str) or name not in registry.lever_names():
            raise InvalidValueError(
                f"verify(levers=...): unknown lever {short_repr(name)}; valid: {choices}"
            )
        spec = lever_spec(name, "verify")
        if name not in probes.PROBES:  # nothing would be measured: refused before any work
            raise InvalidValueError(
                f"verify(levers=...): {short_repr(name)} {UNVERIFIABLE}; valid: "
                f"{', '.join(verifiable_levers())}"
            )
        if values is None:
            chosen: Sequence[Any] = spec.candidates
        elif isinstance(values, (list, tuple)):
            chosen = values  # several values; an SDPA preference is one value: [("flash", "math")]
        else:
            chosen = (values,)
        for value in chosen:  # refuse a bad value before anything runs
            spec.check("verify", value, f"levers[{short_repr(name)}]")
        out[name] = tuple(chosen)
    return out


UNVERIFIABLE = "cannot be verified: no probe measures whether it took effect"


def verifiable_levers() -> list[str]:
    """The levers :func:`verify` measures (``levers=`` and ``verify --levers`` take these).

    Example:
        >>> from speedflags._measure.verdicts import verifiable_levers
        >>> "tf32" in verifiable_levers(), "deterministic" in verifiable_levers()
        (True, False)
    """
    return [name for name in registry.lever_names() if name in probes.PROBES]


def _baseline(ctx: probes.Context) -> Verdict:
    try:
        obs = probes.baseline(ctx)
    except Exception as exc:
        return Verdict("baseline", False, UNMEASURED, reason=_failure(exc))
    if obs.in_effect:
        return Verdict("baseline", False, VERIFIED, obs.figure, measured=obs.measured)
    reason = causes.find("baseline", False, obs, ctx.device)
    return Verdict("baseline", False, NOT_IN_EFFECT, obs.figure, reason, obs.measured)


def _one(ctx: probes.Context, spec: LeverSpec, raw: Any) -> Verdict:
    value = spec.check("verify", raw)
    shown = plain_value(spec.name, value)
    device = ctx.device
    effect = effect_here(spec.name, value, device)  # "medium" on a CPU: as measured
    if effect.unsupported:  # this PyTorch raises for it here: never applied, nothing to probe
        return Verdict(spec.name, shown, REFUSED, reason=effect.reason)
    blocked = causes.environment_block(spec.name, device)
    supported = (effect.effective and not effect.slow) or blocked is not None
    probe = probes.PROBES.get(spec.name)
    if probe is None:
        return Verdict(spec.name, shown, UNMEASURED, reason="no probe for this lever")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a kernel's refusal is reported as the cause
            obs = probe(ctx, value)
    except Exception as exc:
        if not supported and not effect.slow:
            return Verdict(spec.name, shown, NO_EFFECT, reason=effect.reason)
        return Verdict(spec.name, shown, UNMEASURED, reason=_failure(exc))
    if effect.slow and blocked is None:
        return _emulated(spec.name, value, obs, device, effect.reason)
    return judge(spec.name, value, effect.reason if not supported else "", obs, device,
                 notes=effect.reason)  # fmt: skip


def _emulated(
    name: str, value: Any, obs: probes.Observation | None, device: torch.device, reason: str
) -> Verdict:
    """An emulated lever (bf16 autocast on a CPU without bf16 instructions): in effect when
    the probe says so (its output and error are the dtype's), with the slowdown measured."""
    shown = plain_value(name, value)
    if obs is None or not obs.in_effect:  # the probe saw nothing change: say what it saw
        return judge(name, value, reason, obs, device)
    found = slowdown({name: shown}, device)
    measured = {**obs.measured, "slower_factor": 1.0 / found.factor if found.factor else None}
    figure = f"{obs.figure}; {slower(found.factor, found.how)}"
    return Verdict(name, shown, EMULATED, figure, reason, measured)


def _changed(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, ...]:
    """The names whose state differs between two snapshots."""
    return tuple(name for name in {**before, **after} if before.get(name) != after.get(name))


def judge(
    name: str,
    value: Any,
    unsupported: str,
    obs: probes.Observation | None,
    device: torch.device,
    notes: str = "",
) -> Verdict:
    """The verdict for ``name=value`` from what the device supports and what was measured.

    ``unsupported`` is the capability's reason when the device cannot use the lever ("" when
    it can); ``obs`` is the probe's observation (None: no probe runs on this device type);
    ``notes`` is the lever's remark when it works (e.g. "no AMX: the arithmetic stays fp32").

    Example:
        >>> import torch
        >>> from speedflags._measure.verdicts import judge
        >>> from speedflags._measure.probes import Observation
        >>> judge("amp", torch.bfloat16, "", Observation(True, "output bfloat16"),
        ...       torch.device("cpu")).summary()
        'verified: output bfloat16'
    """
    shown = plain_value(name, value)
    figure = obs.figure if obs is not None else ""
    measured = obs.measured if obs is not None else {}
    if unsupported:
        return Verdict(name, shown, NO_EFFECT, figure, unsupported, measured)
    if obs is None:  # pragma: no cover - every probe measures where its lever has an effect
        return Verdict(name, shown, UNMEASURED, reason=f"no probe on {device.type}")
    if obs.in_effect:
        extra = [notes] if notes else []
        if name == "tf32":
            extra.append(causes.conv_note(obs))
        return Verdict(name, shown, VERIFIED, figure, "; ".join(e for e in extra if e), measured)
    if obs.unused:  # a permission the library did not take: nothing failed
        return Verdict(name, shown, NO_EFFECT, figure, obs.unused, measured)
    return Verdict(
        name, shown, NOT_IN_EFFECT, figure, causes.find(name, value, obs, device), measured
    )


def _failure(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"the probe raised {type(exc).__name__}: {first[:200]}"


def environment(device: torch.device) -> dict[str, Any]:
    """Where a verification ran: device name, PyTorch, CUDA, cuDNN, the TF32 overrides."""
    caps = capabilities(device)
    return {
        "device_name": caps.name,
        "compute_capability": list(caps.compute_capability) if caps.compute_capability else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version_or_none(),
        "env": {
            name: os.environ.get(name) for name in (causes.NVIDIA_OVERRIDE, causes.TORCH_OVERRIDE)
        },
    }


def recorded(device: DeviceLike, levers: Mapping[str, Iterable[Any]]) -> dict[str, str]:
    """The verdicts of ``levers`` on ``device``, as ``{label: summary}``, for a result file.

    Never raises: a verification that fails records why instead (bench and ``tune`` results
    keep this beside their figures).

    Example:
        >>> from speedflags._measure.verdicts import recorded
        >>> recorded("cpu", {"tf32": [True]})["tf32=True"].startswith("no effect here")
        True
    """
    try:
        run = verify(device, {name: list(values) for name, values in levers.items()})
    except Exception as exc:
        return {"verify": f"{UNMEASURED}: {_failure(exc)}"}
    out = run.summaries()
    if not run.restored:  # pragma: no cover - every probe's frame restores what it set
        out["restored"] = "some lever read differently after verify"
    return out
