"""What ``verify`` found: one :class:`Verdict` per lever value, and the run around them."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .._short_repr import set_module
from ..errors import InvalidValueError
from .vocabulary import EMULATED, NO_EFFECT, NOT_IN_EFFECT, REFUSED, UNMEASURED, VERIFIED

__all__ = [
    "EMULATED",
    "NOT_IN_EFFECT",
    "NO_EFFECT",
    "REFUSED",
    "UNMEASURED",
    "VERIFIED",
    "Verdict",
    "Verification",
]

FORMAT = "speedflags-verify/1"
# not a failure: measured in effect (emulated included), or nothing the device can change
_OK = (VERIFIED, EMULATED, NO_EFFECT, REFUSED)


class NoVerdictError(InvalidValueError, KeyError):
    """:meth:`Verification.verdict` asked for a lever or value the run has no verdict for:
    an ``InvalidValueError`` that is also the ``KeyError`` it used to raise.

    Example:
        >>> from speedflags._measure.verification import Verification
        >>> try:
        ...     Verification("cpu", []).verdict("amp")
        ... except KeyError as exc:
        ...     print(exc)
        verdict('amp'): this run has no verdict for it; it has: none
    """

    __str__ = BaseException.__str__  # KeyError's would quote the message


@dataclass(frozen=True)
class Verdict:
    """Whether one lever value took effect on the device, and the evidence.

    Attributes:
        lever: the ``fast_math`` keyword (``"tf32"``), or ``"baseline"`` for the fp32
            reference every other lever is compared with (every lever off).
        value: the value entered, in the words a user writes (``True``, ``"bf16"``,
            ``["flash"]``).
        status: a word of the shared vocabulary (:mod:`speedflags._measure.vocabulary`):
            :data:`VERIFIED` (measured in effect), :data:`EMULATED` (measured in effect,
            emulated, so slower than without it: ``figure`` gives the factor measured),
            :data:`NO_EFFECT` (the device cannot use it: ``reason`` says why),
            :data:`REFUSED` (the installed PyTorch raises for it here: never applied),
            :data:`NOT_IN_EFFECT` (the device can, the flags say it is on, and the
            measurement says it is not: ``reason`` gives the cause where one is found) or
            :data:`UNMEASURED` (the probe failed: ``reason``).
        figure: the measurement in words (``"matmul error 2.9e-04 (TF32) against 2.4e-07
            off"``); empty when nothing was measured.
        reason: why not (the capability's reason, or the cause found).
        measured: the numbers behind ``figure`` (errors, dtypes, kernel names).

    Example:
        >>> from speedflags._measure.verification import Verdict
        >>> v = Verdict("amp", "bf16", "verified", "output bfloat16, error 2.9e-03 (bf16)")
        >>> v.label, v.ok
        ("amp='bf16'", True)
    """

    lever: str
    value: Any
    status: str
    figure: str = ""
    reason: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The lever value as a user writes it: ``tf32=True``."""
        if self.lever == "baseline":
            return "baseline (every lever off)"
        return f"{self.lever}={self.value!r}"

    @property
    def ok(self) -> bool:
        """Not a failure: verified (emulated included), without effect on this device, or
        refused by this PyTorch."""
        return self.status in _OK

    def summary(self) -> str:
        """``status: figure; reason`` in one line (what bench and tune results keep)."""
        words = [part for part in (self.figure, self.reason) if part]
        return f"{self.status}: {'; '.join(words)}" if words else self.status

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict, with ``label``."""
        out = asdict(self)
        out["label"] = self.label
        return out


@set_module("speedflags")
@dataclass
class Verification:
    """The outcome of :func:`speedflags.verify`: a verdict per lever value, and where.

    Attributes:
        device: the device verified (``"cuda:0"``, ``"cpu"``).
        verdicts: one :class:`Verdict` per lever value, in registry order, the baseline first.
        environment: device name, PyTorch, CUDA and cuDNN versions, the TF32 environment
            overrides.
        restored: every flag read as before once ``verify`` returned.
        unrestored: the levers and settings that did not (their ``snapshot()`` names).
        elapsed_s: how long it took.

    ``ok`` is true when every verdict is verified or without effect here and the flags came
    back; the command line exits with status 1 otherwise.

    Scope: a plain record; it changes and restores no flag.

    Example:
        >>> from speedflags._measure.verification import Verdict, Verification
        >>> run = Verification("cpu", [Verdict("tf32", True, "no effect here", reason="no GPU")])
        >>> run.ok, run.failed
        (True, [])
        >>> print(run)  # doctest: +NORMALIZE_WHITESPACE
        speedflags verify on cpu
          tf32=True  no effect here  no GPU
        every lever took effect or has no effect here; every flag reads as before
    """

    device: str
    verdicts: list[Verdict]
    environment: dict[str, Any] = field(default_factory=dict)
    restored: bool = True
    elapsed_s: float | None = None
    unrestored: tuple[str, ...] = ()

    @property
    def failed(self) -> list[Verdict]:
        """The verdicts that are failures (requested but not in effect, or unmeasured)."""
        return [v for v in self.verdicts if not v.ok]

    @property
    def ok(self) -> bool:
        """Every lever verified or without effect here, and every flag restored."""
        return self.restored and not self.failed

    def verdict(self, lever: str, value: Any = None) -> Verdict:
        """The verdict of ``lever`` (its first value, or ``value``).

        Raises ``InvalidValueError`` (also a ``KeyError``) if this run has none, naming the
        lever (and value) and the verdicts it has.

        Example:
            >>> from speedflags._measure.verification import Verdict, Verification
            >>> run = Verification("cpu", [Verdict("amp", "bf16", "verified")])
            >>> run.verdict("amp").status
            'verified'
        """
        for v in self.verdicts:
            if v.lever == lever and (value is None or v.value == value):
                return v
        asked = f"{lever}={value!r}" if value is not None else repr(lever)
        have = ", ".join(dict.fromkeys(v.label for v in self.verdicts)) or "none"
        raise NoVerdictError(f"verdict({asked}): this run has no verdict for it; it has: {have}")

    def summaries(self) -> dict[str, str]:
        """``{label: status and figure}`` for every lever value: what results record."""
        return {v.label: v.summary() for v in self.verdicts}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (what :meth:`save` writes)."""
        return {
            "format": FORMAT,
            "device": self.device,
            "ok": self.ok,
            "restored": self.restored,
            "unrestored": list(self.unrestored),
            "elapsed_s": self.elapsed_s,
            "environment": self.environment,
            "verdicts": [v.to_dict() for v in self.verdicts],
        }

    def save(self, path: str) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (its folder is created if needed)."""
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=str)
            fh.write("\n")

    def __str__(self) -> str:
        return render(self)


def _rows(run: Verification) -> list[tuple[str, str, str]]:
    return [
        (v.label, v.status, "; ".join(p for p in (v.figure, v.reason) if p)) for v in run.verdicts
    ]


def render(run: Verification) -> str:
    """The table ``str(run)`` shows: one line per lever value, then the outcome."""
    env = run.environment
    head = f"speedflags verify on {run.device}"
    details = [str(env[k]) for k in ("device_name", "torch") if env.get(k)]
    if details:
        head += f" ({', '.join(details)})"
    if run.elapsed_s is not None:
        head += f", {run.elapsed_s:.1f} s"
    rows = _rows(run)
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
    lines = [head]
    for label, status, words in rows:
        lines.append(f"  {label.ljust(widths[0])}  {status.ljust(widths[1])}  {words}".rstrip())
    failed = run.failed
    if failed:
        names = ", ".join(v.label for v in failed)
        lines.append(f"NOT VERIFIED: {names}")
    elif any(v.status == EMULATED for v in run.verdicts):
        names = ", ".join(v.label for v in run.verdicts if v.status == EMULATED)
        lines.append(
            "every lever took effect or has no effect here; "
            f"emulated, so slower than without it: {names}"
        )
    else:
        lines.append("every lever took effect or has no effect here")
    lines[-1] += (
        "; every flag reads as before"
        if run.restored
        else "; FLAGS NOT RESTORED: "
        + (", ".join(run.unrestored) or "some lever")
        + " read differently than before"
    )
    return "\n".join(lines)
