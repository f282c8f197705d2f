"""A spec's plan: what its levers do on the device it resolves to, worked out on first entry.

For each requested lever, in the registry's order: the lever object for the device type, the
value (``amp="auto"`` and a bare ``fast_math()`` resolved here), and the reason to record;
what this PyTorch refuses is skipped with its reason, and what ``strict=True`` refuses is
listed. The levers become the ledger's :class:`~speedflags.flag_ledger.program.Program`.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from ..flag_ledger.program import LeverItem, Program
from ..hardware import capabilities
from ..levers.autocast import AUTO
from ..levers.registry import check_levers, lever_spec

__all__ = ["Plan", "make_plan", "resolve_auto"]


class Plan(NamedTuple):
    device: str
    program: Program
    refusals: Tuple[str, ...]
    slow: Tuple[Tuple[Any, str], ...]


def make_plan(
    requested: Tuple[Tuple[str, Any], ...], recommend: bool, strict: bool, device: torch.device
) -> Plan:
    """The plan of a spec that asked for ``requested`` (all recommended levers if
    ``recommend``), on ``device``."""
    shown_device = capabilities(device).device
    reasons: Dict[str, str] = {}
    skipped = []
    if recommend:
        from ..recommend import recommended  # local: loaded by the first bare spec's plan

        rec = recommended(device)
        reasons = {k: f"recommended: {v}" for k, v in rec.reasons.items()}
        requested = check_levers("recommended", rec.levers)
        if not requested:
            skipped.append(("*", reasons["*"]))
    items: list[LeverItem] = []
    refusals = []
    slow = []
    for name, value in requested:
        note = reasons.get(name, "")
        lever = lever_spec(name).lever(device.type)
        if value == AUTO:  # amp="auto": the dtype depends on the device
            value, why = resolve_auto(device)
            if value is None:
                skipped.append((name, f"{name}='auto': {why}"))
                continue
            note = f"{name}='auto' chose {lever.describe_value(value)}: {why}"
        effect = lever.available(value, device)
        shown = f"{name}={lever.describe_value(value)!r}"
        if not effect.effective and strict:
            refusals.append(f"{shown}: {effect.reason}")
        if effect.unsupported:  # this PyTorch would raise: recorded as skipped instead
            skipped.append((name, f"{shown}: {effect.reason}"))
            continue
        if effect.slow:
            slow.append(
                (
                    (name, shown_device, str(value)),
                    f"{shown} on {shown_device}: {effect.reason}. Use amp='bf16', or "
                    "strict=True to refuse it.",
                )
            )
        items.append((lever, value, "; ".join(r for r in (note, effect.reason) if r)))
    return Plan(shown_device, Program(items, skipped), tuple(refusals), tuple(slow))


def resolve_auto(device: torch.device) -> Tuple[Optional[torch.dtype], str]:
    """What ``amp="auto"`` means on ``device``: the autocast dtype (or None), and why."""
    caps = capabilities(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None, f"no autocast on {caps.device}: {caps.bf16.reason}"
    if caps.bf16:
        return torch.bfloat16, caps.bf16.reason
    if device.type == "cuda" and caps.fp16:
        return torch.float16, f"no native bf16 ({caps.bf16.reason}); {caps.fp16.reason}"
    return None, f"no native bf16 or fp16 on {caps.device}: {caps.bf16.reason}"
