"""The measured results as figures: per device, what each lever and lever set buys over fp32.

    python benchmarks/plot_results.py --out build/docs-figures [--results benchmarks/results]

Reads every ``speedflags bench --json`` file in the results folder (format
``speedflags-bench/1``; the other files there, verify, tune or overhead runs, are not lever
speedups and are left out) and writes one PNG per device: a panel per workload and size,
one bar per configuration with its speedup over the group's baseline (fp32; the math kernel
for attention), a whisker from the slowest to the fastest of its interleaved passes, and
its relative error against float64. ``make docs`` runs it when a result file changes, and
the site's Measured page (docs/measured.md) shows the figures.

Only what was measured is drawn, and nothing is credited to a lever that does nothing on
the device:

- a configuration the run skipped (TF32 on a CPU, a kernel the device lacks) has no bar;
  the panel says why underneath;
- a lever that had no effect inside a set (``tf32`` in ``tf32+amp-bf16`` on a CPU, from the
  row's notes or the run's ``verify`` verdicts) is named as such in the set's label, and a
  set whose levers all had no effect gets no bar;
- a speedup within the noise of its passes is grey and marked ``~``; one measured emulated
  (bf16 or fp16 on a CPU without the instructions) is hatched and says so.

A device is its name, and for a CPU its family, model and thread count; where several
files measured the same workload and size on one device, the newest run's rows are drawn.
matplotlib is the ``plot`` extra (``pip install '.[plot]'``).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from speedflags._measure.vocabulary import EMULATED, NO_EFFECT, NOT_IN_EFFECT, REFUSED
from speedflags._measure.workloads import WORKLOADS
from speedflags.bench.results import FORMAT, BenchRun, Result
from speedflags.bench.table import finish

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
Key = tuple[str, int | None, bool]  # a panel: workload, size, and whether measured emulated
NOT_CREDITED = (NO_EFFECT, NOT_IN_EFFECT, REFUSED)  # a verdict that earns a lever no credit


@dataclass
class Bar:
    """One configuration's measured speedup, as drawn."""

    label: str
    speedup: float
    low: float  # the slowest and fastest of its passes (speedup where unknown)
    high: float
    rel_error: float | None
    within_noise: bool
    emulated: bool


@dataclass
class Panel:
    """One workload at one size on one device: its bars and what was not drawn, and why."""

    workload: str
    size: int | None
    title: str
    baseline: str
    baseline_error: float | None
    bars: list[Bar] = field(default_factory=list)
    not_drawn: list[str] = field(default_factory=list)


@dataclass
class Figure:
    """One device's figure: its file name, its title and the result files it draws."""

    slug: str
    title: str
    sources: list[Path]
    panels: list[Panel] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # workloads the device does not run


def bench_files(folder: Path = RESULTS) -> list[Path]:
    """The ``speedflags bench --json`` files in ``folder``, by name."""
    import json

    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT:
            found.append(path)
    return found


def device_of(run: BenchRun) -> tuple[str, str]:
    """``(slug, title)`` of the device a run measured: a GPU by its name; a CPU by its name,
    family and model and the threads it ran with (they change what a lever buys)."""
    env = run.environment
    name = str(env.get("device_name") or env.get("device") or "unknown device")
    if not str(env.get("device", "")).startswith("cpu"):
        return _slug(name), name
    cpu = env.get("cpu_id") or {}
    features = set(cpu.get("features") or ())
    isa = (
        ", ".join(
            label
            for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))
            if flag in features
        )
        or "no bf16 instructions"
    )
    name = re.sub(r"\((R|TM)\)|\bProcessor\b", "", name).strip()
    name = re.sub(r"\s+", " ", name)
    family = f"family {cpu['cpu family']} model {cpu['model']}" if "model" in cpu else ""
    threads = int(env.get("threads") or 0)
    count = f"{threads} thread" + ("" if threads == 1 else "s")
    title = f"{name} ({', '.join(p for p in (family, isa) if p)}), {count}"
    return _slug(f"{name} {family} {count}"), title


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _components(workload: str, config: str) -> dict[str, object]:
    """The lever values of a configuration, from the workload's declaration ({} if unknown)."""
    known = WORKLOADS.get(workload)
    for declared in known.configs if known is not None else ():
        if declared.name == config:
            return dict(declared.levers)
    return {}


def _verdict(verdicts: dict[str, str], lever: str, value: object) -> str:
    for key in (f"{lever}={value!r}", f"{lever}={[value]!r}"):
        if key in verdicts:
            return verdicts[key]
    return ""


def _uncredited(row: Result, verdicts: dict[str, str]) -> dict[str, str]:
    """The levers of ``row`` that did nothing on its device, with the words saying so."""
    out: dict[str, str] = {}
    for note in row.notes:
        lever, _, rest = note.partition(": ")
        if rest.startswith("no effect"):
            out[lever] = NO_EFFECT
    for lever, value in _components(row.workload, row.config).items():
        said = _verdict(verdicts, lever, value)
        for status in NOT_CREDITED:
            if said.startswith(status):
                out[lever] = status
    return out


def _label(row: Result, uncredited: dict[str, str]) -> str:
    parts = row.config.split("+")
    names = dict(_components(row.workload, row.config))
    kept = [p for p in parts if not _is_uncredited(p, names, uncredited)]
    label = "+".join(kept) if kept else row.config
    for lever, status in uncredited.items():
        label += f" ({lever}: {status})"
    return label


def _is_uncredited(part: str, levers: dict[str, object], uncredited: dict[str, str]) -> bool:
    # a part of the name is the lever's when it is the lever's own name or its value's
    # spelling in a configuration name ("tf32", "cudnn-benchmark", "precision-high")
    for lever in uncredited:
        value = levers.get(lever)
        spelled = {lever, lever.replace("_", "-"), f"{lever.split('_')[-1]}-{value}"}
        if part in spelled or part == str(value):
            return True
    return False


def _reason(skipped: str) -> str:
    # the reason's first clause: "no effect on cpu", "fp16 is not native on cpu"
    return re.split(r": | \(", skipped, maxsplit=1)[0]


def _spread(row: Result, base: Result) -> tuple[float, float]:
    ratios = [
        b / r
        for r, b in zip(row.pass_medians_s, base.pass_medians_s, strict=False)
        if r > 0 and b > 0
    ]
    speedup = row.speedup or 0.0
    if len(ratios) < 2:
        return speedup, speedup
    return min(min(ratios), speedup), max(max(ratios), speedup)


def figures(paths: Iterable[Path]) -> list[Figure]:
    """One :class:`Figure` per device measured in ``paths`` (no drawing: no matplotlib)."""
    runs: dict[str, list[tuple[str, Path, BenchRun]]] = {}
    titles: dict[str, str] = {}
    for path in paths:
        run = BenchRun.load(str(path))
        slug, title = device_of(run)
        titles[slug] = title
        runs.setdefault(slug, []).append((str(run.environment.get("date", "")), path, run))
    out = []
    for slug, found in runs.items():
        figure = Figure(slug, titles[slug], [])
        chosen: dict[Key, tuple[Path, BenchRun, list[Result]]] = {}
        absent: dict[str, str] = {}
        for _, path, run in sorted(found, key=lambda item: item[0]):  # the newest last: wins
            for key, rows in _groups(finish(run.results)).items():
                if key[1] is None and all(r.skipped for r in rows):
                    absent[key[0]] = _reason(rows[0].skipped or "")
                else:
                    chosen[key] = (path, run, rows)
        order = list(WORKLOADS)
        for key in sorted(chosen, key=lambda k: (_rank(order, k[0]), k[2], k[1] or 0)):
            path, run, rows = chosen[key]
            if path not in figure.sources:
                figure.sources.append(path)
            figure.panels.append(_panel(rows, run.environment.get("verdicts") or {}))
        figure.sources.sort()
        drawn = {key[0] for key in chosen}
        figure.absent = [f"{w}: {why}" for w, why in absent.items() if w not in drawn]
        out.append(figure)
    return sorted(out, key=lambda f: f.slug)


def _rank(order: list[str], workload: str) -> int:
    return order.index(workload) if workload in order else len(order)


def _groups(rows: Iterable[Result]) -> dict[Key, list[Result]]:
    groups: dict[Key, list[Result]] = {}
    for row in rows:
        key = (row.workload, row.size, row.group.endswith("(emulated)"))
        groups.setdefault(key, []).append(row)
    return groups


def _panel(rows: Sequence[Result], verdicts: dict[str, str]) -> Panel:
    base = next((r for r in rows if r.baseline and r.median_s), None)
    first = rows[0]
    shape = first.shape or f"{first.workload} {first.size}"
    emulated = first.group.endswith("(emulated)")
    panel = Panel(
        first.workload,
        first.size,
        f"{first.workload}: {shape}" + (" (emulated, measured once)" if emulated else ""),
        base.config if base is not None else "",
        base.rel_error if base is not None else None,
    )
    skipped: dict[str, list[str]] = {}
    for row in rows:
        if row.baseline:
            continue
        if row.skipped or row.speedup is None or base is None:
            why = _reason(row.skipped) if row.skipped else "no baseline measured"
            skipped.setdefault(why, []).append(row.config)
            continue
        uncredited = _uncredited(row, verdicts)
        levers = _components(row.workload, row.config)
        if levers and set(levers) <= set(uncredited):  # nothing in it did anything here
            skipped.setdefault(NO_EFFECT, []).append(row.config)
            continue
        low, high = _spread(row, base)
        panel.bars.append(
            Bar(
                _label(row, uncredited),
                row.speedup,
                low,
                high,
                row.rel_error,
                row.within_noise,
                row.verdict == EMULATED,
            )
        )
    panel.not_drawn = [f"{', '.join(configs)}: {why}" for why, configs in skipped.items()]
    return panel


# ---- drawing (matplotlib, the plot extra) ----

FASTER, SLOWER, NOISE = "#2e7d32", "#c62828", "#9e9e9e"


def draw(figure: Figure, path: Path) -> None:
    """Write ``figure`` as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows: dict[str, list[Panel]] = {}
    for panel in figure.panels:
        rows.setdefault(panel.workload, []).append(panel)
    columns = max(len(p) for p in rows.values())
    heights = [max(len(p.bars) for p in panels) + 2.2 for panels in rows.values()]
    fig = plt.figure(figsize=(5.6 * columns, 0.4 * sum(heights) + 1.6), layout="constrained")
    grid = fig.add_gridspec(len(rows), columns, height_ratios=heights)
    values = [v for p in figure.panels for b in p.bars for v in (b.low, b.high)] or [1.0]
    left, right = min(min(values), 1.0) / 1.6, max(max(values), 1.0) * 30
    for i, panels in enumerate(rows.values()):
        for j, panel in enumerate(panels):
            _draw_panel(fig.add_subplot(grid[i, j]), panel, (left, right))
    lines = [f"{figure.title}: speedup over the baseline, per workload"]
    lines.append(textwrap.fill("from " + ", ".join(p.name for p in figure.sources), 150))
    if figure.absent:
        lines.append("not run here: " + "; ".join(figure.absent))
    fig.suptitle("\n".join(lines), fontsize=12)
    handles = [
        Patch(color=FASTER, label="faster, beyond the noise of its passes"),
        Patch(color=SLOWER, label="slower, beyond the noise"),
        Patch(color=NOISE, label="~ within the noise: no difference shown"),
    ]
    if any(b.emulated for p in figure.panels for b in p.bars):
        handles.append(Patch(facecolor="white", edgecolor=SLOWER, hatch="//", label="emulated"))
    fig.legend(
        handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False
    )
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _draw_panel(ax: object, panel: Panel, limits: tuple[float, float]) -> None:
    from matplotlib.axes import Axes

    assert isinstance(ax, Axes)
    ys = list(range(len(panel.bars)))[::-1]
    for y, bar in zip(ys, panel.bars, strict=True):
        faster = bar.speedup > 1
        color = NOISE if bar.within_noise else FASTER if faster else SLOWER
        ax.barh(  # from 1x to the speedup, either way
            y,
            abs(bar.speedup - 1.0),
            left=min(bar.speedup, 1.0),
            height=0.6,
            color="white" if bar.emulated else color,
            edgecolor=color,
            hatch="//" if bar.emulated else None,
        )
        if bar.high > bar.low:
            ax.errorbar(
                bar.speedup,
                y,
                xerr=[[bar.speedup - bar.low], [bar.high - bar.speedup]],
                fmt="none",
                ecolor="black",
                elinewidth=0.9,
                capsize=2.5,
            )
        error = "" if bar.rel_error is None else f"  error {bar.rel_error:.1e}"
        shown = f"{bar.speedup:.2f}x" + (" ~" if bar.within_noise else "") + error
        ax.text(max(bar.high, bar.speedup, 1.0) * 1.08, y, shown, va="center", fontsize=9)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlim(*limits)
    # ticks under the bars only: the room on the right is for the figures
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if limits[0] <= t <= limits[1] / 15]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_yticks(ys, [b.label for b in panel.bars], fontsize=9)
    ax.set_ylim(-0.8, max(len(panel.bars), 1) - 0.2)
    base = f"1x = {panel.baseline}" if panel.baseline else "no baseline"
    if panel.baseline_error is not None:
        base += f" (error {panel.baseline_error:.1e})"
    ax.set_title(f"{textwrap.fill(panel.title, 46)}\n{base}", fontsize=10, loc="left")
    if panel.not_drawn:
        note = "not drawn: " + "; ".join(panel.not_drawn)
        ax.set_xlabel(textwrap.fill(note, 62), fontsize=8, color="#555555", loc="left")
    if not panel.bars:
        ax.text(1.0, 0, "  nothing measured beside the baseline", va="center", fontsize=8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder for the PNGs")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    args = parser.parse_args(argv)
    made = figures(bench_files(args.results))
    if not made:
        print(f"plot_results.py: no speedflags bench files in {args.results}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*.png"):  # a device no longer measured is not served
        if stale.stem not in {f.slug for f in made}:
            stale.unlink()
    for figure in made:
        path = args.out / f"{figure.slug}.png"
        draw(figure, path)
        bars = sum(len(p.bars) for p in figure.panels)
        print(f"{path}: {figure.title}, {len(figure.panels)} panels, {bars} bars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
