"""``@speedup(cuda_graphs=True)`` on a GPU: the three checks its documentation promises.

    PYTHONPATH=$PWD python3 benchmarks/cuda_graphs_check.py --out DIR [--rounds 30]

- **speed**: the small transformer's train step (``benchmarks/test_train_step.py``: 2 encoder
  layers, d_model 256, batch 16 x 64 tokens, fused AdamW), launch-bound on a fast GPU, timed
  round-robin by ``train_step_interleaved.py`` as fp32 eager, ``@speedup(amp="bf16")``,
  compiled, and ``@speedup(amp="bf16", cuda_graphs=True)``; the goal is the last at 2x fp32
  eager or more (reported, not a failure).
- **scheduler**: the same step with its learning rate a tensor on the GPU, under a
  ``LambdaLR`` that changes the rate at every call, trained for ``--steps`` calls graphed and
  eagerly (bf16 autocast both) from one initialisation on the same batches: the losses must
  agree within bf16's tolerance, the rate must have changed, and dynamo must not compile
  again after the warm-up calls (its count of graphs stays put).
- **shapes**: the graphed step fed 20 distinct sequence lengths: the first 8 are recorded,
  the other 12 run eagerly, with one ``CudaGraphsWarning`` naming the shapes; the losses
  agree with eager's.

Each case's figures and problems go to ``DIR/cuda-graphs-check.json`` (the speed case's
full timing also to ``DIR/cuda-graphs-speed.json``). Without CUDA every case says "skipped:
no CUDA" and the script exits 0; otherwise it exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step_interleaved
from test_train_step import BATCH, CLASSES, D_MODEL, parts

import speedflags

FORMAT = "speedflags-cuda-graphs-check/1"
SPEEDUP_GOAL = 2.0
LOSS_TOLERANCE = 3e-2  # bf16 keeps 8 mantissa bits (train_step_interleaved's bound)
WARMUP_CALLS = 3  # the graph trees' warm-up run, the recording, a first replay
SKIPPED = "skipped: no CUDA"
SPEED_VARIANTS = "fp32-eager,speedup-bf16,speedup-bf16-compile,speedup-bf16-cuda-graphs"


def _batch(seq: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, D_MODEL, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH, seq), generator=gen)
    return x.to(device), y.to(device)


def _trainer(device: str, graphed: bool, schedule: bool) -> tuple[Any, Any, Any]:
    """A train step (bf16 autocast; graphed or eager), its optimizer and its scheduler."""
    train_step, _, opt = parts(device, torch.tensor(1e-3, device=device))
    sched = None
    if schedule:  # a new rate at every call: warm-up then decay
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10) * 0.97**i)
    step = speedflags.speedup(amp="bf16", device=device, cuda_graphs=graphed)(train_step)
    return step, opt, sched


def _worst(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def speed(out: Path, rounds: int) -> dict[str, Any]:
    path = out / "cuda-graphs-speed.json"
    argv = ["--device", "cuda", "--rounds", str(rounds), "--variants", SPEED_VARIANTS]
    code = train_step_interleaved.main([*argv, "--json", str(path)])
    data = json.loads(path.read_text(encoding="utf-8"))
    variants = {v["variant"]: v for v in data["variants"]}
    graphed = variants["speedup-bf16-cuda-graphs"]
    achieved = graphed.get("speedup_vs_baseline")
    return {
        "json": str(path),
        "speedup_vs_fp32_eager": achieved,
        "goal": SPEEDUP_GOAL,
        "goal_met": bool(achieved is not None and achieved >= SPEEDUP_GOAL),
        "speedups": {k: v.get("speedup_vs_baseline") for k, v in variants.items()},
        "graph_launches_per_step": graphed.get("graph_launches_per_step"),
        "cuda_graphs": graphed.get("cuda_graphs"),
        "problems": list(data["problems"]) + ([] if code == 0 else [f"exit {code}"]),
    }


def scheduler(steps: int, device: str = "cuda") -> dict[str, Any]:
    from torch._dynamo.utils import counters

    problems: list[str] = []
    batches = [_batch(64, seed, device) for seed in range(8)]
    runs: dict[str, list[float]] = {}
    graph_counts: list[int] = []
    rates: list[float] = []
    stats: dict[str, Any] = {}
    for graphed in (False, True):
        step, opt, sched = _trainer(device, graphed, schedule=True)
        lr = opt.param_groups[0]["lr"]
        losses = []
        for i in range(steps):
            losses.append(float(step(*batches[i % len(batches)])))
            sched.step()
            if graphed:
                graph_counts.append(int(counters["stats"]["unique_graphs"]))
                rates.append(float(opt.param_groups[0]["lr"]))
        runs["graphed" if graphed else "eager"] = losses
        if graphed:
            stats = step.stats.to_dict()
            if opt.param_groups[0]["lr"] is not lr:
                problems.append("the scheduler replaced the learning-rate tensor")
    worst = _worst(runs["graphed"], runs["eager"])
    if not worst < LOSS_TOLERANCE:
        problems.append(f"losses differ from eager's by {worst:.2e}")
    later = graph_counts[WARMUP_CALLS:]
    if later and len(set(later)) != 1:
        problems.append(f"dynamo compiled again after the warm-up: graph counts {graph_counts}")
    if len(set(rates)) < 2:
        problems.append("the learning rate never changed")
    if stats.get("mode") != "compiled" or (stats.get("cuda_graphs") or {}).get("state") != "on":
        problems.append(f"not graphed: {stats}")
    return {
        "steps": steps,
        "losses": runs,
        "loss_rel_err_vs_eager": worst,
        "learning_rates": rates,
        "dynamo_graph_counts": graph_counts,
        "stats": stats,
        "problems": problems,
    }


def shapes(device: str = "cuda") -> dict[str, Any]:
    problems: list[str] = []
    lengths = list(range(40, 60))  # 20 distinct sequence lengths
    batches = [_batch(n, n, device) for n in lengths]
    runs: dict[str, list[float]] = {}
    said: list[str] = []
    stats: dict[str, Any] = {}
    for graphed in (False, True):
        step, _, _ = _trainer(device, graphed, schedule=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", speedflags.CudaGraphsWarning)
            runs["graphed" if graphed else "eager"] = [float(step(x, y)) for x, y in batches]
        if graphed:
            said = [str(w.message) for w in caught if w.category is speedflags.CudaGraphsWarning]
            stats = step.stats.to_dict()
    graphs = stats.get("cuda_graphs") or {}
    limit = graphs.get("limit")
    limit_said = [m for m in said if "past the limit" in m]
    if len(limit_said) != 1:
        problems.append(f"expected one warning about the shape limit, got {len(limit_said)}")
    if (graphs.get("recorded"), graphs.get("beyond_limit")) != (limit, len(lengths) - (limit or 0)):
        problems.append(f"recorded {graphs.get('recorded')}, beyond {graphs.get('beyond_limit')}")
    worst = _worst(runs["graphed"], runs["eager"])
    if not worst < LOSS_TOLERANCE:
        problems.append(f"losses differ from eager's by {worst:.2e}")
    return {
        "lengths": lengths,
        "losses": runs,
        "loss_rel_err_vs_eager": worst,
        "warnings": said,
        "stats": stats,
        "problems": problems,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen cases; write the JSON; 0 when every check passed (or no CUDA)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the results (created)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (speed case)")
    parser.add_argument("--steps", type=int, default=30, help="train steps (scheduler case)")
    parser.add_argument("--cases", default="speed,scheduler,shapes")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in ("speed", "scheduler", "shapes")]
    if unknown or not cases:
        parser.error(f"--cases: unknown {unknown}; known: speed, scheduler, shapes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    results: dict[str, Any] = {}
    for case in cases:
        if not cuda:
            results[case] = {"skipped": SKIPPED}
        elif case == "speed":
            results[case] = speed(out, args.rounds)
        elif case == "scheduler":
            results[case] = scheduler(args.steps)
        else:
            results[case] = shapes()
        found = results[case]
        if "skipped" in found:
            line = found["skipped"]
        elif found["problems"]:
            line = "WRONG: " + "; ".join(found["problems"])
        else:
            line = "ok"
        if case == "speed" and "speedup_vs_fp32_eager" in found:
            line += f" ({found['speedup_vs_fp32_eager']:.2f}x fp32 eager, goal {SPEEDUP_GOAL}x)"
        print(f"{case}: {line}")
    data = {
        "format": FORMAT,
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": torch.cuda.get_device_name() if cuda else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "speedflags": speedflags.__version__,
        },
        "cases": results,
    }
    path = os.path.join(out, "cuda-graphs-check.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=str)
    print(f"results: {path}")
    return 1 if any(r.get("problems") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
