"""What the examples share: lever arguments, step timing, the speedup line, and the check
that every flag ends as it began (``speedflags.snapshot()`` before and after)."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

import torch

import speedflags
from speedflags.levers.registry import LEVER_NAMES, baseline_levers

# Plain fp32: TF32 off, matmul precision "highest", no autocast, no cuDNN benchmark.
FP32: Dict[str, Any] = baseline_levers()


def parse_levers(text: str) -> Dict[str, Any]:
    """``"tf32=true,amp=bf16,sdpa=flash+math"`` -> ``fast_math`` keyword arguments."""
    levers: Dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in LEVER_NAMES:
            raise argparse.ArgumentTypeError(
                f"--levers {item!r}: expected name=value with a name among {', '.join(LEVER_NAMES)}"
            )
        word = value.strip().lower()
        if word in ("true", "false"):
            levers[name] = word == "true"
        elif "+" in value:
            levers[name] = tuple(value.split("+"))
        else:
            levers[name] = value.strip()
    speedflags.fast_math(**levers)  # validate now, with speedflags' own error message
    return levers


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="a few seconds on a CPU (CI)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--levers",
        type=parse_levers,
        default=None,
        help="fast_math levers, e.g. tf32=true,amp=bf16 (default: the recommended ones)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="take the levers from a bench file (its first configuration with levers other "
        "than the baseline), as `speedflags bench --config FILE` compares them",
    )


def pick_device(name: Optional[str], smoke: bool) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    return torch.device(name)


def chosen_levers(
    given: Optional[Dict[str, Any]],
    device: torch.device,
    config: Optional[str] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """The levers to compare with fp32: as given, from a bench file, or the recommended ones."""
    if given is not None and config is not None:
        raise SystemExit("give --levers or --config, not both")
    if config is not None:
        return config_levers(config)
    if given is not None:
        return dict(given)
    return {**speedflags.recommended(device).levers, **extra}


def config_levers(path: str) -> Dict[str, Any]:
    """The first configuration of a bench file (or tune lever file) that sets levers and is
    not the baseline; the same file ``speedflags bench --config`` reads."""
    from speedflags.bench.config_file import load_for_cli

    bench, problem = load_for_cli(path)
    if bench is None:
        raise SystemExit(f"--config: {problem}")
    for config in bench.configs:
        if not config.baseline and config.levers and config.dtype is None:
            print(f"levers from {path}: {config.name} = {config.describe()}")
            return dict(config.levers)
    raise SystemExit(f"--config {path!r}: no configuration besides the baseline sets levers")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(step: Callable[[], Any], steps: int, device: torch.device) -> float:
    """One warm-up step, then the mean time of ``steps`` steps (synchronised on CUDA)."""
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / max(steps, 1)


def print_speedup(
    name: str, fp32_s: float, fast_s: float, levers: Dict[str, Any], smoke: bool = False
) -> None:
    shown = ", ".join(f"{k}={v!r}" for k, v in levers.items()) or "none (nothing faster here)"
    note = " (--smoke: sizes too small for the timing to mean anything)" if smoke else ""
    print(
        f"{name}: fp32 {fp32_s * 1e3:.2f} ms/step; speedflags ({shown}) "
        f"{fast_s * 1e3:.2f} ms/step; speedup vs fp32: {fp32_s / fast_s:.2f}x{note}"
    )


@contextmanager
def flags_as_found() -> Iterator[None]:
    """Fail (exit 1) if any flag differs at the end from the start."""
    before = speedflags.snapshot()
    yield
    after = speedflags.snapshot()
    if after != before:
        changed = sorted(k for k in before if before[k] != after.get(k))
        print(f"flags changed: {', '.join(changed)}", file=sys.stderr)
        raise SystemExit(1)
    print("flags as found at the start: yes (speedflags.snapshot() unchanged)")
