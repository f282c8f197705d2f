"""``python -m speedflags report``: the device, both TF32 API families, every lever's state.

With ``apply=True`` the recommended levers are entered (a normal ``fast_math()`` frame) and
each one's before/after is shown; with ``restore=True`` the frame is exited and the full
snapshot is compared with the one taken first, getter by getter.

In a ``torch.distributed`` job (``torchrun ... -m speedflags report``) every rank builds its
report and the ranks' states are gathered: the report then shows each rank's state and one
verdict line, consistent or not and where not. The state compared is the one read at the
start, or, with ``apply=True``, the one inside the applied frame.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

import torch

from . import _distributed as distributed
from ._fast_math import fast_math
from ._hardware import capabilities, resolve_device
from ._ledger.history import json_default
from ._ledger.ledger import ledger
from ._measure.lever_files import plain_value
from ._measure.vocabulary import verdicts_here
from ._recommend import recommended
from ._status import snapshot, tf32_status
from ._version import __version__
from ._watch.writers import last_writers, watching
from .levers import _fp32_model as family
from .levers import _fp32_torch as family_io
from .levers import autocast as autocast_module
from .levers import registry
from .levers import sdpa as sdpa_module

__all__ = ["build_report", "lever_verdicts", "render_report"]


def _api_in_use() -> str:
    if not family_io.HAS_NEW_API:
        return f"legacy only (PyTorch {torch.__version__} has no fp32_precision API)"
    state = family_io.read_state()
    if not family.is_consistent(state):
        return "mixed: the legacy and new APIs disagree (see conflicts; speedflags.heal_tf32())"
    nodes = state[family.F_NODES] or ()
    parents = [
        f"{family.NODE_NAMES[i]}={nodes[i]!r}"
        for i in (family.GENERIC, family.CUDA, family.MKLDNN)
        if nodes and nodes[i] != "none"
    ]
    if parents:
        return "new API at a parent node (" + ", ".join(parents) + "); both families agree"
    return "legacy-compatible: both families agree and no fp32_precision parent node is set"


def torch_features() -> dict[str, dict[str, Any]]:
    """What this PyTorch has that speedflags uses, found by feature detection.

    Each entry: ``{"present": bool, "note": str}``; the note says what speedflags does
    without it.
    """
    version = torch.__version__
    backends = [n for n in sdpa_module.BACKENDS if n in sdpa_module.PRESENT]
    missing = [n for n in sdpa_module.BACKENDS if n not in sdpa_module.PRESENT]
    return {
        "fp32_precision API": {
            "present": family_io.HAS_NEW_API,
            "note": ""
            if family_io.HAS_NEW_API
            else f"PyTorch {version} has the legacy TF32 API only; speedflags reads and "
            "writes it alone",
        },
        "SDPA priority order": {
            "present": sdpa_module.HAS_PRIORITY,
            "note": ""
            if sdpa_module.HAS_PRIORITY
            else f"PyTorch {version} has none: sdpa= enables the preferred kernels but "
            "cannot put them first",
        },
        "SDPA backends": {
            "present": not missing,
            "note": ", ".join(backends)
            + (f" (PyTorch {version} has no {', '.join(missing)})" if missing else ""),
        },
        "device-generic autocast getters": {
            "present": autocast_module.HAS_DEVICE_GENERIC,
            "note": ""
            if autocast_module.HAS_DEVICE_GENERIC
            else autocast_module.NO_DEVICE_GENERIC_NOTE,
        },
        "torch.distributed": {
            "present": distributed.AVAILABLE,
            "note": ""
            if distributed.AVAILABLE
            else f"PyTorch {version} is built without it: check_ranks() compares nothing",
        },
    }


def gather_ranks(report: dict[str, Any], state: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's identity and ``state``, gathered, with the verdict; None without a group.

    A collective: every rank of the default process group must call it.
    """
    group = distributed.process_group()
    if group is None:
        return None
    rank, world_size, backend = group
    payload = {
        "rank": rank,
        "host": platform.node(),
        "pid": os.getpid(),
        "device": report["device"],
        "device_name": report["device_name"],
        "torch": report["torch"],
        "state": state,
    }
    gathered = distributed.gather(payload)
    diffs = distributed.differences(
        [{"torch": {"__version__": p["torch"]}, **p["state"]} for p in gathered]
    )
    return {
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "consistent": not diffs,
        "verdict": distributed.verdict(diffs, world_size),
        "differences": {key: list(values) for key, values in diffs.items()},
        "states": gathered,
    }


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    flat_before: dict[str, Any] = {}
    flat_after: dict[str, Any] = {}
    _flatten("", before, flat_before)
    _flatten("", after, flat_after)
    return [
        {"getter": key, "before": flat_before.get(key), "after": flat_after.get(key)}
        for key in sorted(set(flat_before) | set(flat_after))
        if flat_before.get(key) != flat_after.get(key)
    ]


def build_report(
    device: str | None = None, apply: bool = False, restore: bool = False
) -> dict[str, Any]:
    """Everything ``speedflags report`` shows, as a JSON-friendly dict.

    Scope: reads process-wide flags and the calling thread's autocast state. With
    ``apply`` it enters a ``fast_math()`` frame (recommended levers); with ``restore`` it
    exits it and reports whether every getter answers as before.

    Example:
        >>> from speedflags.report import build_report
        >>> report = build_report("cpu", apply=True, restore=True)
        >>> report["restore"]["exact"]
        True
    """
    target = resolve_device(device, "report")
    caps = capabilities(target)
    rec = recommended(target)
    report: dict[str, Any] = {
        "speedflags": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": caps.device,
        "device_name": caps.name,
        "capabilities": caps.to_dict(),
        "features": torch_features(),
        "tf32_api": {"in_use": _api_in_use(), **tf32_status().to_dict()},
        "levers": snapshot(),
        # snapshot key -> the write that set its current value (speedflags.watch() saw it)
        "last_written_by": last_writers(),
        "watching": watching(),
        "recommended": {"levers": rec.levers, "reasons": rec.reasons},
        # each value tune would try, in the words verify, bench and tune use
        "lever_verdicts": lever_verdicts(target),
    }
    compared = distributed.rank_state() if distributed.process_group() is not None else None
    if apply:
        before = snapshot()
        spec = fast_math(device=str(target), label="speedflags report --apply")
        frame = spec.__enter__()
        try:
            inside = snapshot()
            report["apply"] = {
                "levers": frame.values,
                "changes": _diff(before, inside),
                "records": [r.to_dict() for r in ledger().history if r.frame == frame.id],
            }
            if compared is not None:
                compared = distributed.rank_state()
        finally:
            if restore:
                spec.__exit__(None, None, None)
        if restore:
            after = snapshot()
            mismatches = _diff(before, after)
            flat: dict[str, Any] = {}
            _flatten("", before, flat)
            report["restore"] = {
                "exact": not mismatches,
                "getters_compared": len(flat),
                "mismatches": mismatches,
            }
    if compared is not None:
        report["ranks"] = gather_ranks(report, compared)
    return report


def lever_verdicts(device: torch.device) -> list[dict[str, Any]]:
    """Each lever value ``tune`` would try, with its word on ``device`` (in effect, no effect
    here, in effect, emulated: slower, refused by this PyTorch) and the reason: what the
    device's answers say, not measured (``speedflags verify`` measures).

    Example:
        >>> import torch
        >>> from speedflags.report import lever_verdicts
        >>> found = {v["label"]: v["status"] for v in lever_verdicts(torch.device("cpu"))}
        >>> found["tf32=True"]
        'no effect here'
    """
    levers = [(spec.name, plain_value(spec.name, spec.validate(value)))
              for spec in registry.specs() for value in spec.candidates]  # fmt: skip
    out = []
    for name, value in levers:
        (found,) = verdicts_here({name: value}, device)
        out.append({"label": found.label, "status": found.status, "reason": found.reason})
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "no "


def render_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`build_report`'s result."""
    lines: list[str] = []
    add = lines.append
    add(
        f"speedflags {report['speedflags']} · PyTorch {report['torch']} "
        f"(CUDA {report['cuda'] or 'none'}) · Python {report['python']}"
    )
    add(f"device: {report['device']} — {report['device_name']}")
    add("")
    add("capabilities")
    for name, cap in report["capabilities"].items():
        if isinstance(cap, dict):
            add(f"  {name:15s} {_yes(cap['supported'])}  {cap['reason']}")
    add("")
    add(f"PyTorch {report['torch']} features (found by feature detection)")
    for name, feature in report["features"].items():
        add(f"  {name:32s} {_yes(feature['present'])}  {feature['note']}".rstrip())
    add("")
    api = report["tf32_api"]
    add(f"TF32 API: {api['api']} — {api['in_use']}")
    add(f"  consistent: {api['consistent']}")
    for conflict in api["conflicts"]:
        add(f"  conflict: {conflict}")
    env = ", ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in api["env"].items())
    add(f"  environment: {env}")
    for note in api["notes"]:
        add(f"  note: {note}")
    add("")
    flat: dict[str, Any] = {}
    _flatten("", report["levers"], flat)
    lines += _render_levers(
        flat, report.get("last_written_by") or {}, report.get("watching", False)
    )
    add("")
    verdicts = report.get("lever_verdicts") or []
    if verdicts:
        add(f"what each lever does on {report['device']} (`speedflags verify` measures it)")
        width = max(len(v["label"]) for v in verdicts)
        status_width = max(len(v["status"]) for v in verdicts)
        for verdict in verdicts:
            add(
                f"  {verdict['label']:{width}s}  {verdict['status']:{status_width}s}  "
                f"{verdict['reason']}".rstrip()
            )
        add("")
    rec = report["recommended"]
    shown = ", ".join(f"{k}={v!r}" for k, v in rec["levers"].items()) or "(none)"
    add(f"recommended for {report['device']}: {shown}")
    for lever, reason in rec["reasons"].items():
        add(f"  {lever}: {reason}")
    if "apply" in report:
        add("")
        add("--apply: fast_math() entered")
        for record in report["apply"]["records"]:
            reason = f"  ({record['reason']})" if record["reason"] else ""
            add(f"  {record['action']} {record['lever']}{reason}")
        for change in report["apply"]["changes"]:
            add(f"    {change['getter']}: {change['before']!r} -> {change['after']!r}")
        if not report["apply"]["changes"]:
            add("    (no getter changed)")
    if "restore" in report:
        add("")
        restored = report["restore"]
        if restored["exact"]:
            add(f"--restore: exact — all {restored['getters_compared']} getters answer as before")
        else:
            add(f"--restore: NOT exact — {len(restored['mismatches'])} getters differ:")
            for change in restored["mismatches"]:
                add(f"    {change['getter']}: {change['before']!r} -> {change['after']!r}")
    if report.get("ranks"):
        add("")
        lines += _render_ranks(report["ranks"])
    return "\n".join(lines)


# what the column says of a value no write changed while the watch ran
UNWRITTEN = "-"


def _render_levers(flat: dict[str, Any], writers: dict[str, str], watching: bool) -> list[str]:
    """The state, with a "last written by" column wherever a watch runs (or ran: writers
    known), ``-`` for a value nothing wrote while it watched (as found)."""
    shown = {key: f"  {key} = {value!r}" for key, value in flat.items()}
    if not writers and not watching:
        return ["levers and guarded settings (current state)", *shown.values()]
    width = max(len(line) for line in shown.values())
    heading = "levers and guarded settings (current state)"
    lines = [
        f"{heading:{width}s}  last written by (speedflags.watch(); {UNWRITTEN}: not written "
        "since it started)"
    ]
    for key, line in shown.items():
        lines.append(f"{line:{width}s}  {writers.get(key, UNWRITTEN)}")
    return lines


MAX_RANK_COLUMNS = 8
_CELL = 24


def _cell(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _CELL else text[: _CELL - 1] + "…"


def _render_ranks(ranks: dict[str, Any]) -> list[str]:
    world_size = ranks["world_size"]
    states = ranks["states"]
    lines = [
        f"ranks: {world_size} (torch.distributed, {ranks['backend']}); this is rank "
        f"{ranks['rank']}'s report"
    ]
    for p in states:
        lines.append(
            f"  rank {p['rank']}: {p['host']} pid {p['pid']} · {p['device']} ({p['device_name']})"
            f" · PyTorch {p['torch']}"
        )
    flat = [distributed.flatten(p["state"]) for p in states]
    keys: list[str] = []
    for one in flat:
        keys += [key for key in one if key not in keys]
    width = max(len(k) for k in keys) if keys else 10
    differs = ranks["differences"]
    lines.append("  state per rank (* where the ranks differ)")
    if world_size <= MAX_RANK_COLUMNS:
        header = "".join(f"  {'rank ' + str(i):{_CELL}s}" for i in range(world_size))
        lines.append(f"    {'getter':{width}s}{header}")
        for key in keys:
            cells = "".join(f"  {_cell(one.get(key, distributed.ABSENT)):{_CELL}s}" for one in flat)
            mark = "*" if key in differs else " "
            lines.append(f"  {mark} {key:{width}s}{cells}".rstrip())
    else:  # too many columns: each value once, with the ranks that have it
        for key in keys:
            values = [one.get(key, distributed.ABSENT) for one in flat]
            mark = "*" if key in differs else " "
            lines.append(f"  {mark} {key}: {distributed.describe_values(values)}")
    lines.append(f"verdict: {ranks['verdict']}")
    return lines


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(report, sys.stdout, indent=2, default=json_default)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_report(report) + "\n")
