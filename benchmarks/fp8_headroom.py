"""FP8 headroom: a float8 (e4m3) matmul through PyTorch's scaled matmul, against bf16 and fp32.

Whether an FP8 lever would be worth building: the float8 e4m3 matmul that PyTorch's scaled
matmul (``torch._scaled_mm``) runs on sm89 and newer GPUs, with tensor-wise scales (one
float32 scale per operand), timed round-robin with a bf16 matmul of the same shape and the
float32 one, at 4096³ and 8192³. Each row gives the median time, TFLOP/s (2n³ per product),
the share of the device's dense datasheet peak for its arithmetic
(``tools/gpu_check/peaks.py``) and the relative error against float64 on the same inputs:

    python benchmarks/fp8_headroom.py [--sizes 4096,8192] [--rounds 30] [--json PATH]

Rows: ``fp32`` (float32 operands, TF32 as PyTorch's setting leaves it: off by default),
``bf16`` (bf16 operands and output: the 16-bit ceiling), ``fp8`` (e4m3 operands already
scaled, bf16 output), ``fp8-fast-accum`` (the same with cuBLAS's faster, less precise
accumulation, where this PyTorch takes ``use_fast_accum``) and ``fp8-with-casts`` (the bf16
operands scaled and cast to e4m3 in every call, in eager PyTorch and unfused: the most the
casts of a dynamically scaled layer cost). The second operand is column-major (a weight
``(out, in)`` used transposed), as the scaled matmul requires. Each round runs every row
once, in turn, several products per sample (5 ms or more), rotating between two input sets
so that repeated products do not run from the L2 cache; on a GPU each sample is timed with
CUDA events.

Without a CUDA GPU that runs FP8 (compute capability 8.9 or newer, and a PyTorch with
``torch._scaled_mm``) it says so in one line, runs the same code on the CPU at tiny sizes
where this PyTorch has a CPU scaled matmul (a dry run: nothing it prints is a
measurement), writes the JSON and exits 0. It exits 1 when a result is not finite or an
error is out of its arithmetic's range (a broken scaling shows there).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tools/
from tools.gpu_check.peaks import measured_for, peak_for

FORMAT = "speedflags-fp8-headroom/1"
CUDA_SIZES = (4096, 8192)
CPU_SIZES = (64, 128)
CONFIGS = ("fp32", "bf16", "fp8", "fp8-fast-accum", "fp8-with-casts")
# the arithmetic each row is put against the peak of
ARITHMETIC = {"fp32": "fp32", "bf16": "bf16"} | {c: "fp8" for c in CONFIGS if "fp8" in c}
# the largest relative error each arithmetic may show on random normal inputs (e4m3 keeps 3
# mantissa bits: about 3e-2; bf16 8 bits: about 3e-3); beyond it, something is broken
MAX_ERROR = {"fp32": 1e-4, "bf16": 1e-2, "fp8": 1e-1}
SAMPLE_S = {"cuda": 5e-3, "cpu": 1e-3}  # the least time one sample takes (several products)
INPUT_SETS = 2


@dataclass(frozen=True)
class ScaledMmForm:
    """How this PyTorch's ``torch._scaled_mm`` is called, read from its operator schema.

    Attributes:
        returns_tuple: it returns ``(out, amax)`` (PyTorch 2.1 to 2.4), not the tensor alone.
        fast_accum: it takes ``use_fast_accum`` (PyTorch 2.2 on).
        scales_keyword_only: ``scale_a`` and ``scale_b`` are keyword-only and optional
            (PyTorch 2.1 to 2.3); later they are positional and required. Passing them by
            keyword works with both.

    Example:
        >>> form = scaled_mm_form("aten::_scaled_mm(Tensor self, Tensor mat2, *, "
        ...     "Tensor? bias=None, ScalarType? out_dtype=None, Tensor? scale_a=None, "
        ...     "Tensor? scale_b=None, Tensor? scale_result=None) -> (Tensor, Tensor)")
        >>> form.returns_tuple, form.fast_accum, form.scales_keyword_only
        (True, False, True)
    """

    returns_tuple: bool
    fast_accum: bool
    scales_keyword_only: bool


def scaled_mm_form(schema: str | None = None) -> ScaledMmForm | None:
    """The form of ``torch._scaled_mm`` from its schema (this PyTorch's when ``schema`` is
    None); None when there is no such operator or it takes no tensor-wise scales.

    Example:
        >>> scaled_mm_form("aten::_scaled_mm(Tensor self, Tensor mat2, Tensor scale_a, "
        ...     "Tensor scale_b, Tensor? bias=None, Tensor? scale_result=None, "
        ...     "ScalarType? out_dtype=None, bool use_fast_accum=False) -> Tensor")
        ScaledMmForm(returns_tuple=False, fast_accum=True, scales_keyword_only=False)
    """
    if schema is not None:
        parsed: Any = torch._C.parse_schema(schema)
    else:
        if not hasattr(torch, "_scaled_mm"):
            return None
        try:
            schemas = torch._C._jit_get_schemas_for_operator("aten::_scaled_mm")
        except (AttributeError, RuntimeError):
            return None
        found = [s for s in schemas if s.overload_name == ""]
        if not found:
            return None
        parsed = found[0]
    arguments = {a.name: a for a in parsed.arguments}
    if not {"scale_a", "scale_b", "out_dtype"} <= set(arguments):
        return None
    return ScaledMmForm(
        returns_tuple=len(parsed.returns) > 1,
        fast_accum="use_fast_accum" in arguments,
        scales_keyword_only=bool(arguments["scale_a"].kwarg_only),
    )


def fp8_missing(
    capability: tuple[int, int] | None, form: ScaledMmForm | None, has_dtype: bool
) -> str:
    """Why a CUDA device of ``capability`` (None: no CUDA device) cannot run this benchmark's
    FP8 matmul with this PyTorch; empty when it can.

    Example:
        >>> form = ScaledMmForm(returns_tuple=False, fast_accum=True, scales_keyword_only=False)
        >>> fp8_missing((9, 0), form, True)
        ''
        >>> fp8_missing((8, 0), form, True)
        'compute capability 8.0: FP8 tensor cores need 8.9 (Ada) or newer'
    """
    if not has_dtype:
        return f"PyTorch {torch.__version__} has no torch.float8_e4m3fn"
    if form is None:
        return f"PyTorch {torch.__version__} has no torch._scaled_mm with tensor-wise scales"
    if capability is None:
        return "no CUDA GPU"
    if tuple(capability) < (8, 9):
        major, minor = capability
        return f"compute capability {major}.{minor}: FP8 tensor cores need 8.9 (Ada) or newer"
    return ""


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as float8 e4m3 with one float32 scale (tensor-wise): ``x ≈ q.float() * scale``.

    The scale maps the largest magnitude to e4m3's largest finite value (448), and the
    scaled values are clamped there: past it, PyTorch's cast gives NaN or saturates,
    depending on the kernel.

    Example:
        >>> import torch
        >>> q, scale = quantize(torch.tensor([[1000.0, -2000.0]]))
        >>> q.dtype, round(float(scale) * 448), (q.float() * scale).tolist()
        (torch.float8_e4m3fn, 2000, [[1000.0, -2000.0]])
    """
    top = torch.finfo(torch.float8_e4m3fn).max
    amax = x.abs().amax().float()
    scale = torch.clamp(amax / top, min=1e-12)
    q = (x.float() / scale).clamp(-top, top).to(torch.float8_e4m3fn)
    return q, scale


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``scale_a * scale_b * (a @ b)`` through ``torch._scaled_mm``, on any PyTorch that has it:
    the scales by keyword (positional from 2.4, keyword-only before), the tensor alone
    (2.1 to 2.4 return ``(out, amax)``). ``b`` must be column-major (``w.t()``).

    Example (recent PyTorch runs it on a CPU too; 2.1 only on CUDA):
        >>> import torch
        >>> (qa, sa), (qb, sb) = quantize(torch.randn(16, 32)), quantize(torch.randn(16, 32))
        >>> scaled_mm(qa, qb.t(), sa, sb).dtype  # doctest: +SKIP
        torch.bfloat16
    """
    kwargs: dict[str, Any] = {"scale_a": scale_a, "scale_b": scale_b, "out_dtype": out_dtype}
    if fast_accum:
        kwargs["use_fast_accum"] = True
    result: Any = torch._scaled_mm(a, b, **kwargs)  # a tuple from PyTorch 2.1 to 2.4
    out: torch.Tensor = result[0] if isinstance(result, tuple) else result
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius), in float64; NaN when ``out`` is not finite.

    Example:
        >>> import torch
        >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64))
        0.0
    """
    diff = out.double() - ref
    if not bool(torch.isfinite(diff).all()):
        return math.nan
    return float(diff.norm() / ref.norm())


@dataclass
class _Operands:
    """One input set: the float32 operands and their bf16 and e4m3 copies (``bt`` is the
    second operand stored ``(n, k)``, used transposed: column-major)."""

    a32: torch.Tensor
    bt32: torch.Tensor
    a16: torch.Tensor
    bt16: torch.Tensor
    qa: torch.Tensor
    qbt: torch.Tensor
    sa: torch.Tensor
    sbt: torch.Tensor


def _operands(n: int, device: torch.device, seed: int) -> _Operands:
    gen = torch.Generator(device=device).manual_seed(seed)
    a32 = torch.randn(n, n, device=device, generator=gen)  # random, never zeros
    bt32 = torch.randn(n, n, device=device, generator=gen)
    a16, bt16 = a32.bfloat16(), bt32.bfloat16()
    (qa, sa), (qbt, sbt) = quantize(a16), quantize(bt16)
    return _Operands(a32, bt32, a16, bt16, qa, qbt, sa, sbt)


def _calls(form: ScaledMmForm | None, fp8: str) -> dict[str, Callable[[_Operands], Any]]:
    """Each row's product of one input set; the FP8 rows only where they can run (``fp8``
    empty), ``fp8-fast-accum`` only where this PyTorch takes it."""
    calls: dict[str, Callable[[_Operands], Any]] = {
        "fp32": lambda o: o.a32 @ o.bt32.t(),
        "bf16": lambda o: o.a16 @ o.bt16.t(),
    }
    if fp8:
        return calls
    calls["fp8"] = lambda o: scaled_mm(o.qa, o.qbt.t(), o.sa, o.sbt)
    if form is not None and form.fast_accum:
        calls["fp8-fast-accum"] = lambda o: scaled_mm(o.qa, o.qbt.t(), o.sa, o.sbt, fast_accum=True)

    def with_casts(o: _Operands) -> torch.Tensor:
        (qa, sa), (qbt, sbt) = quantize(o.a16), quantize(o.bt16)
        return scaled_mm(qa, qbt.t(), sa, sbt)

    calls["fp8-with-casts"] = with_casts
    return calls


def _cpu_fp8_missing(form: ScaledMmForm | None) -> str:
    """Why this PyTorch cannot run the scaled matmul on the CPU; empty when it can."""
    missing = fp8_missing((9, 0), form, hasattr(torch, "float8_e4m3fn"))
    if missing:
        return missing
    try:
        q, s = quantize(torch.ones(16, 16))
        scaled_mm(q, q.t(), s, s)
    except (NotImplementedError, RuntimeError) as exc:
        first = str(exc).split(". ")[0].splitlines()[0] if str(exc) else type(exc).__name__
        return f"PyTorch {torch.__version__} has no CPU kernel for torch._scaled_mm ({first})"
    return ""


def _rotating(call: Callable[[_Operands], Any], sets: list[_Operands]) -> Callable[[], Any]:
    """``call`` on each input set in turn, one per product."""
    cycle = itertools.cycle(sets)
    return lambda: call(next(cycle))


class _Clock:
    """Seconds per product over ``count`` products: CUDA events on a GPU, else the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], Any], count: int) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / count
        begin = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - begin) / count


def measure(
    n: int,
    device: torch.device,
    form: ScaledMmForm | None,
    fp8: str,
    rounds: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """Every row at size ``n``: median seconds per product over ``rounds`` round-robin
    samples, and the relative error of one product against float64 on the same inputs
    (``fp8``: why the FP8 rows cannot run; empty when they can).

    Example:
        >>> import torch
        >>> rows = measure(32, torch.device("cpu"), scaled_mm_form(), "no FP8 here", 1, 0)
        >>> [(r["config"], r["rel_error"] < 1e-2) for r in rows]
        [('fp32', True), ('bf16', True)]
    """
    sets = [_operands(n, device, seed) for seed in range(INPUT_SETS)]
    ref = sets[0].a32.double() @ sets[0].bt32.double().t()
    calls = _calls(form, fp8)
    errors = {name: relative_error(call(sets[0]), ref) for name, call in calls.items()}
    del ref
    clock = _Clock(device)
    bound = {name: _rotating(call, sets) for name, call in calls.items()}
    counts: dict[str, int] = {}
    for name, fn in bound.items():
        for _ in range(warmup):
            fn()
        once = clock.time(fn, 1)
        counts[name] = max(1, min(1000, math.ceil(SAMPLE_S[device.type] / max(once, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in bound.items():
            samples[name].append(clock.time(fn, counts[name]))
    rows = []
    for name in calls:
        values = samples[name]
        low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values * 3)
        median = statistics.median(values)
        rows.append(
            {
                "size": n,
                "config": name,
                "arithmetic": ARITHMETIC[name],
                "median_s": median,
                "iqr_s": [low, high],
                "samples": len(values),
                "products_per_sample": counts[name],
                "tflop_per_s": 2 * n**3 / median / 1e12,
                "rel_error": errors[name],
            }
        )
    return rows


def _add_ratios(rows: list[dict[str, Any]], device_name: str) -> None:
    """Speedups against bf16 and fp32 of the same size, and shares of the peaks."""
    peak = peak_for(device_name)
    measured = measured_for(peak[0]) if peak else {}
    for row in rows:
        same = {r["config"]: r for r in rows if r["size"] == row["size"]}
        for base in ("bf16", "fp32"):
            if base in same:
                row[f"speedup_vs_{base}"] = same[base]["median_s"] / row["median_s"]
        top = peak[1].get(row["arithmetic"]) if peak else None
        row["peak_tflop_per_s"] = top
        row["of_peak"] = row["tflop_per_s"] / top if top else None
        best = measured.get(row["arithmetic"])
        row["published_max_tflop_per_s"] = best
        row["of_published_max"] = row["tflop_per_s"] / best if best else None


def _environment(device: torch.device, form: ScaledMmForm | None) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
        "compute_capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "scaled_mm": None if form is None else form.__dict__,
    }


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'size':>5}  {'config':15s} {'median':>10}  {'TFLOP/s':>8}  {'of dense peak':>22}  "
        f"{'vs bf16':>7}  {'vs fp32':>7}  {'rel. error':>10}"
    ]
    for r in rows:
        share = "-"
        if r.get("of_peak") is not None:
            share = f"{100 * r['of_peak']:.0f}% of {r['peak_tflop_per_s']:g} {r['arithmetic']}"
        lines.append(
            f"{r['size']:>5}  {r['config']:15s} {r['median_s'] * 1e3:8.3f} ms  "
            f"{r['tflop_per_s']:8.3g}  {share:>22}  {r.get('speedup_vs_bf16', 0):6.2f}x  "
            f"{r.get('speedup_vs_fp32', 0):6.2f}x  {r['rel_error']:10.1e}"
        )
        if r.get("of_published_max") is not None and r["arithmetic"] == "fp8":
            lines[-1] += (
                f"  ({100 * r['of_published_max']:.0f}% of the published measured maximum, "
                f"{r['published_max_tflop_per_s']:g})"
            )
    return lines


def _problems(rows: list[dict[str, Any]]) -> list[str]:
    """Each row whose error is not finite or out of its arithmetic's range."""
    found = []
    for r in rows:
        limit = MAX_ERROR[r["arithmetic"]]
        if not r["rel_error"] <= limit:  # NaN fails too
            found.append(f"{r['config']} at {r['size']}: error {r['rel_error']:.2e} > {limit:g}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Measure (or, without an FP8 GPU, dry-run) and report; 0 unless a result is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda (the default where there is one) or cpu (a dry run)",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated n for n x n @ n x n (4096,8192 on a GPU; 64,128 in a dry run)",
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed products per row (3)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        parser.error(f"--sizes: comma-separated whole numbers, not {args.sizes!r}")
    if sizes is not None and (not sizes or min(sizes) < 16 or any(s % 16 for s in sizes)):
        parser.error("--sizes: multiples of 16 (the scaled matmul needs them), at least 16")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    form = scaled_mm_form()
    has_cuda = torch.cuda.is_available()
    want_cuda = args.device == "cuda" or (args.device is None and has_cuda)
    capability = tuple(torch.cuda.get_device_capability()) if has_cuda else None
    why_not = fp8_missing(capability, form, hasattr(torch, "float8_e4m3fn"))  # type: ignore[arg-type]
    dry = not (want_cuda and not why_not)
    if want_cuda and not has_cuda:
        why_not = "no CUDA GPU"
    if dry and not why_not:
        why_not = "--device cpu"
    device = torch.device("cpu" if dry else "cuda")
    fp8 = _cpu_fp8_missing(form) if dry else ""
    sizes = sizes or list(CPU_SIZES if dry else CUDA_SIZES)
    rounds = min(args.rounds, 3) if dry else args.rounds
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rows += measure(n, device, form, fp8, rounds, args.warmup)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env = _environment(device, form)
    _add_ratios(rows, env["device_name"] if device.type == "cuda" else "")
    problems = _problems(rows)
    where = env["device_name"] if device.type == "cuda" else "the CPU"
    print(f"fp8 headroom: {where}, torch {torch.__version__}, {rounds} rounds, median per product")
    for line in _table(rows):
        print(line)
    if fp8:
        print(f"fp8 rows not run: {fp8}")
    for problem in problems:
        print(f"WRONG: {problem}")
    data = {
        "format": FORMAT,
        "environment": env,
        "settings": {
            "sizes": sizes,
            "rounds": rounds,
            "warmup": args.warmup,
            "input_sets": INPUT_SETS,
            "dry_run": dry,
        },
        "no_fp8_gpu": why_not if dry else None,
        "fp8_rows_skipped": fp8 or None,
        "results": rows,
        "problems": problems,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
        print(f"results: {args.json}")
    if dry:
        print(
            f"fp8 headroom: not measured ({why_not}): a dry run on "
            f"the CPU at sizes {', '.join(map(str, sizes))}, no figure above is a measurement"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
