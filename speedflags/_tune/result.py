"""What ``tune`` found: one row per candidate, the choice, and ways to keep them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .._measure.lever_files import PathLike, write_file
from .._measure.noise import within_noise
from .._measure.plot_axes import speedup_axes
from .._measure.vocabulary import EMULATED
from .._short_repr import set_module
from .._version import install_hint

__all__ = ["PLOT_MISSING", "Row", "TuneResult"]

PLOT_MISSING = "TuneResult.plot needs matplotlib, an optional extra of speedflags: " + install_hint(
    "plot"
)
_FLOOR = 1e-9  # an exact result (error 0) is drawn here on the log axis


@dataclass
class Row:
    """One candidate ``tune`` tried (or skipped), measured against plain fp32.

    Attributes:
        levers: its ``fast_math`` keyword arguments, in users' words (``{"amp": "bf16"}``).
        speedup: fp32 time / its time, measured in the same round; ``None`` if not timed.
        error: the largest relative error of its outputs against fp32's; ``math.inf`` for
            an output that is not finite; ``None`` if it never ran.
        accepted: within the error budget and faster than fp32 beyond the noise.
        note: why it was skipped, rejected, dropped or not chosen.
        stage: ``"lever"`` (one lever), ``"combination"``, ``"compile"`` or
            ``"cuda_graphs"``.
        compile: run through ``speedup(compile=True, ...)``.
        cuda_graphs: run through ``speedup(cuda_graphs=True, ...)`` (compiled, with CUDA
            graphs; tried on a GPU for a launch-bound step: :mod:`speedflags._tune.graphs`).
        median_s: its median time per call; rounds: timed calls; noise: the relative
            standard error of ``speedup`` (from the spread of its paired passes, see
            :mod:`speedflags._tune.compare`).
        verdict: a word of the shared vocabulary where the candidate is not plainly in
            effect: ``"in effect, emulated: slower"`` for one timed once only (bf16 autocast
            on a CPU without bf16 instructions), never accepted.
        drift: for a ``param_dtype`` candidate within the budget, the largest relative gap of the
            step's outputs to fp32's after several steps in a row from the same start (a
            train step's loss after that many optimizer steps).

    Example:
        >>> from speedflags._tune.result import Row
        >>> row = Row({"amp": "bf16"}, speedup=1.7, error=4e-3, accepted=True)
        >>> row.label
        "amp='bf16'"
    """

    levers: dict[str, Any]
    speedup: float | None = None
    error: float | None = None
    accepted: bool = False
    note: str = ""
    stage: str = "lever"
    compile: bool = False
    cuda_graphs: bool = False
    median_s: float | None = None
    noise: float | None = None
    rounds: int = 0
    verdict: str = ""
    drift: float | None = None

    @property
    def within_noise(self) -> bool:
        """Whether ``speedup`` is no difference from fp32 beyond its ``noise`` (False where
        either is unknown)."""
        if self.speedup is None or self.noise is None:
            return False
        return within_noise(self.speedup, self.noise)

    @property
    def label(self) -> str:
        """The candidate in the words a user writes."""
        parts = [f"{k}={v!r}" for k, v in self.levers.items()] or ["(fp32)"]
        if self.cuda_graphs:
            parts.append("cuda_graphs=True")
        elif self.compile:
            parts.append("compile=True")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("error", "drift"):
            if out[name] is not None and not math.isfinite(out[name]):
                out[name] = None  # JSON and TOML have no portable infinity; the note says why
        return out


@set_module("speedflags")
@dataclass
class TuneResult:
    """The outcome of :func:`speedflags.tune`: the choice, every candidate, the run.

    Attributes:
        best: the chosen ``fast_math`` keyword arguments (``{"amp": "bf16"}``); ``{}``
            when nothing beats plain fp32 within the budget. Pass a non-empty choice to
            ``fast_math(**result.best)`` or ``@speedup(**result.best)`` (a bare
            ``fast_math()`` applies the recommended levers, not fp32).
        rows: every candidate, in the order tried (:class:`~speedflags._tune.result.Row`).
        budget: the error budget; device: the device tuned on; reference_s: the fp32
            median time per call; elapsed_s: how long tuning took.
        compile: whether ``speedup(compile=True, **best)`` beat ``best`` beyond the noise
            (``None``: not tried). Compiled code is run with inductor's ``fallback_random``
            so that dropout draws what eager drew and the error compares arithmetic only.
        cuda_graphs: whether ``speedup(cuda_graphs=True, **best)`` beat ``best`` beyond the
            noise (``None``: not tried: a CPU, or a step that is not launch-bound, as
            ``notes`` says).
        state: what was reset before each call.
        torch_version: the PyTorch that measured it.
        verdicts: whether each lever value timed takes effect on the device, as
            :func:`speedflags.verify` found it (``{"amp='bf16'": "verified: ..."}``).
        confidence: ``"clear"``, or ``"within noise"`` when the choice's runner-up (or, with
            no choice, the fastest median) is not apart from it beyond the noise, even after
            the paired duel of :mod:`speedflags._tune.duel`; ``confidence_note`` gives both
            figures (``"amp='bf16' and matmul_precision='medium' within noise: 1.30x ± 0.20
            vs 1.20x ± 0.10"``).

    Scope: a plain record; it changes and restores no flag.

    Example:
        >>> from speedflags import TuneResult
        >>> from speedflags._tune.result import Row
        >>> result = TuneResult({"amp": "bf16"}, [Row({"amp": "bf16"}, 1.7, 4e-3, True)],
        ...                     budget=0.05, device="cpu", reference_s=0.07)
        >>> print(result)  # doctest: +NORMALIZE_WHITESPACE
        speedflags tune on cpu, error budget 0.05: fp32 takes 70 ms per call
          levers         speedup  error    accepted  note
          amp='bf16'       1.70x  4.0e-03  yes
        best: fast_math(amp='bf16')
    """

    best: dict[str, Any]
    rows: list[Row]
    budget: float
    device: str
    reference_s: float | None = None
    elapsed_s: float | None = None
    compile: bool | None = None
    cuda_graphs: bool | None = None
    state: str = ""
    torch_version: str = ""
    notes: list[str] = field(default_factory=list)
    verdicts: dict[str, str] = field(default_factory=dict)
    confidence: str = "clear"
    confidence_note: str = ""

    @property
    def chosen(self) -> Row | None:
        """The row of :attr:`best` (eager), or ``None`` when fp32 stays."""
        for row in self.rows:
            if row.levers == self.best and not row.compile and row.accepted:
                return row
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (what :meth:`save` writes)."""
        chosen = self.chosen
        return {
            "levers": dict(self.best),
            "tune": {
                "speedup": chosen.speedup if chosen else 1.0,
                "error": chosen.error if chosen else 0.0,
                "budget": self.budget,
                "device": self.device,
                "compile": self.compile,
                "cuda_graphs": self.cuda_graphs,
                "reference_s": self.reference_s,
                "elapsed_s": self.elapsed_s,
                "state": self.state,
                "torch": self.torch_version,
                "confidence": self.confidence,
                "confidence_note": self.confidence_note,
                "verdicts": dict(self.verdicts),
            },
            "rows": [row.to_dict() for row in self.rows],
        }

    def save(self, path: PathLike) -> None:
        """Write the choice and the rows to ``path``: ``.json``, ``.toml`` or ``.yaml``.

        :func:`speedflags.load_levers` reads the choice back. YAML needs PyYAML
        (``pip install '.[yaml]'``), imported only here. A missing folder is
        created, with its parents.

        Raises:
            InvalidValueError: another suffix (the message lists the valid ones).
            ImportError: ``.yaml`` without PyYAML.
            OSError: the file cannot be written.
        """
        write_file(path, self.to_dict())

    def plot(self, path: PathLike) -> int:
        """Write a PNG of speedup against error to ``path``; return the points drawn.

        One point per measured candidate (the chosen one highlighted), fp32 at (0, 1x), the
        budget as a vertical line. matplotlib is an optional extra
        (``pip install '.[plot]'``), imported only here. A missing folder is
        created, with its parents.

        Raises:
            ImportError: matplotlib is not installed (the message says how to install it).
        """
        rows = [r for r in self.rows if r.speedup is not None and r.error is not None]
        rows = [r for r in rows if math.isfinite(r.error or 0.0)]
        with speedup_axes(
            path,
            missing=PLOT_MISSING,
            xlabel="relative error against fp32 (log scale)",
            ylabel="speedup over fp32 (x)",
            title=f"speedflags tune on {self.device}: {_choice(self)}",
        ) as ax:
            for accepted, marker, name in ((True, "o", "accepted"), (False, "x", "not accepted")):
                group = [r for r in rows if r.accepted == accepted]
                if group:
                    xs = [max(r.error or 0.0, _FLOOR) for r in group]
                    ys = [r.speedup for r in group]
                    ax.scatter(xs, ys, marker=marker, s=48, label=name)
            for row in rows:
                ax.annotate(
                    row.label,
                    (max(row.error or 0.0, _FLOOR), row.speedup),
                    textcoords="offset points",
                    xytext=(5, 4),
                    fontsize=7,
                    fontweight="bold" if row is self.chosen else "normal",
                )
            ax.scatter([_FLOOR], [1.0], marker="s", color="grey", label="fp32 (reference)")
            ax.axvline(self.budget, color="red", linewidth=0.8, linestyle=":", label="budget")
        return len(rows) + 1

    def __str__(self) -> str:
        return render(self)


def _choice(result: TuneResult) -> str:
    if result.best:
        return "fast_math(" + ", ".join(f"{k}={v!r}" for k, v in result.best.items()) + ")"
    raced = [row for row in result.rows if row.speedup is not None and row.verdict != EMULATED]
    emulated = [row.label for row in result.rows if row.verdict == EMULATED]
    if not raced and emulated:
        # the only levers timed run emulated here: say that, not "no lever beats it"
        return (
            f"plain fp32 (nothing is faster here: {', '.join(emulated)} run emulated, slower; "
            "every other candidate was skipped or failed)"
        )
    if not raced:
        # every candidate skipped (no effect here) or failed: "beats" would claim a race
        # that was never run
        return "plain fp32 (nothing was measured against it: every candidate was skipped or failed)"
    return "plain fp32 (no lever beats it within the budget)"


def ms(seconds: float | None) -> str:
    """A duration in ms (or us), three significant digits."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} us"


def _cells(row: Row) -> tuple[str, str, str, str, str]:
    if row.speedup is None:
        speedup = "-"
    else:
        speedup = f"{row.speedup:.2f}x" if row.speedup >= 0.1 else f"{row.speedup:.2g}x"
        speedup += " ~" if row.within_noise else ""
    if row.error is None:
        error = "-"
    else:
        error = "inf" if not math.isfinite(row.error) else f"{row.error:.1e}"
    note = row.note
    if row.drift is not None:  # param_dtype: what several steps in a row do
        gap = "inf" if not math.isfinite(row.drift) else f"{row.drift:.1e}"
        note = "; ".join(n for n in (note, f"output gap to fp32 after several steps {gap}") if n)
    return (row.label, speedup, error, "yes" if row.accepted else "no", note)


def render(result: TuneResult) -> str:
    """The readable table ``str(result)`` shows."""
    head = (
        f"speedflags tune on {result.device}, error budget {result.budget:g}: "
        f"fp32 takes {ms(result.reference_s)} per call"
    )
    if result.elapsed_s is not None:
        head += f" (tuned in {result.elapsed_s:.1f} s)"
    table = [("levers", "speedup", "error", "accepted", "note")]
    table.extend(_cells(row) for row in result.rows)
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [head]
    for cells in table:
        left = cells[0].ljust(widths[0])
        mid = [cells[1].rjust(widths[1]), cells[2].ljust(widths[2]), cells[3].ljust(widths[3])]
        lines.append(f"  {left}  {'  '.join(mid)}  {cells[4]}".rstrip())
    if any(row.within_noise for row in result.rows):
        lines.append(
            "  ~ within the noise of its interleaved passes: no difference from fp32 shown"
        )
    lines.append(f"best: {_choice(result)}")
    if result.confidence != "clear":
        lines.append(f"confidence: {result.confidence_note or result.confidence}")
    if result.compile is not None:
        verdict = "helps on top of it" if result.compile else "does not help beyond the noise"
        lines.append(f"compile: speedup(compile=True, ...) {verdict}")
    if result.cuda_graphs is not None:
        verdict = "helps on top of it" if result.cuda_graphs else "does not help beyond the noise"
        lines.append(f"cuda_graphs: speedup(cuda_graphs=True, ...) {verdict}")
    lines.extend(result.notes)
    lines.extend(f"verify: {label}: {said}" for label, said in result.verdicts.items())
    return "\n".join(lines)
