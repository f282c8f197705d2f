"""Does ``tune`` name the same choice run after run while a neighbour loads the cores?

The acceptance check of issue 22: the same ``speedflags.tune`` call on the MLP forward
1024 -> 2048 -> 1024 at batch 256 (budget 5e-2), run several times in a row, must name the
same best set each time, or say "within noise". Run from the repository root::

    python benchmarks/tune_noise.py                 # 5 runs, as the machine is
    python benchmarks/tune_noise.py --busy 2        # 5 runs beside 2 busy-looping processes

``--busy N`` starts N processes that spin (``python -c "while True: pass"``) before the
first run and ends them (by their own process ids) after the last, whatever happens.
Each run prints its table; at the end one line per run (choice, confidence, speedups,
tuning time) and the verdict. ``--json PATH`` saves every run's ``TuneResult``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import speedflags


def mlp() -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    return model, torch.randn(256, 1024)


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg", encoding="ascii").read().split()[:3])
    except OSError:
        return "?"


def one_run(index: int, seconds: float) -> speedflags.TuneResult:
    model, x = mlp()
    began = time.perf_counter()
    result = speedflags.tune(model, x, budget=5e-2, seconds=seconds)
    print(f"--- run {index + 1} ({time.perf_counter() - began:.0f} s, load {_load()})")
    print(result, flush=True)
    return result


def summary(index: int, result: speedflags.TuneResult) -> str:
    timed = sorted(
        (r for r in result.rows if r.speedup is not None and not r.compile),
        key=lambda r: -(r.speedup or 0),
    )
    shown = ", ".join(f"{r.label} {r.speedup:.2f}x ± {(r.noise or 0) * (r.speedup or 0):.2f}"
                      for r in timed[:3]) or "no lever timed"  # fmt: skip
    best = ", ".join(f"{k}={v!r}" for k, v in result.best.items()) or "fp32"
    note = f" ({result.confidence_note})" if result.confidence != "clear" else ""
    elapsed = f"{result.elapsed_s:.0f} s" if result.elapsed_s is not None else "?"
    return f"run {index + 1}: best {best}; {result.confidence}{note}; {shown}; {elapsed}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes beside it")
    parser.add_argument("--seconds", type=float, default=120.0, help="tune's bound per run")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="save every run's result here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = speedflags.capabilities("cpu")
    print(f"{caps.name}; bf16: {caps.bf16.reason}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads; load {_load()}")  # fmt: skip
    busy: list[subprocess.Popen[bytes]] = []
    results: list[speedflags.TuneResult] = []
    try:
        for _ in range(args.busy):
            busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        if busy:
            time.sleep(5)  # let the load average climb
            print(f"busy: {args.busy} processes ({', '.join(str(p.pid) for p in busy)})")
        for index in range(args.runs):
            results.append(one_run(index, args.seconds))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    lines = [summary(i, r) for i, r in enumerate(results)]
    choices = {json.dumps(r.best, sort_keys=True) for r in results if r.confidence == "clear"}
    same = len(choices) <= 1
    print("\n".join(["", *lines]))
    print("verdict: " + ("the same choice every run, or said within noise" if same else
                         f"DIFFERENT clear choices: {sorted(choices)}"))  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        data: dict[str, Any] = {"busy": args.busy, "runs": [r.to_dict() for r in results]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, default=str)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
