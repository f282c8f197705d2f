"""``param_dtype`` against autocast on a ResNet-18 (built from ``torch.nn``), interleaved.

Every round runs each variant once, in turn (each round starting with the next one, so that
no variant always follows the same neighbour), after a warm-up round, so that the medians
come from the same stretch of time and a busy neighbour hits all of them alike; the speed against
autocast is given as the median of the per-round ratios and as the ratio of the fastest
rounds (the steadier of the two on a shared machine):

- training step (forward, backward, AdamW step, batch ``--batch`` at ``--size``²):
  ``fp32``; ``autocast`` (``torch.autocast`` around the forward and loss, as users write
  it); ``param_dtype`` (one ``fast_math(model=net, param_dtype="bf16")`` block held around
  all the steps); ``param_dtype per step`` (the block entered around every step, as
  ``@speedup(model=net, param_dtype="bf16")`` does).
- inference (``torch.inference_mode()``): ``fp32``, ``autocast`` around each call,
  ``param_dtype`` held around all the calls.

Before timing, each training variant trains its own copy of one initialisation for a few
steps on the same batches: its losses must stay within bf16's reach of autocast's, and its
weights must move (a block held around the steps whose casts were never renewed would
freeze them). ``--json PATH`` writes every median, quartile and ratio, with the machine.

    .venv/bin/python benchmarks/resnet_param_dtype.py [--rounds 15] [--threads N] [--json P]

Numbers: benchmarks/RESULTS.md ("ResNet-18 on a CPU: param_dtype against autocast").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import speedflags

FORMAT = "speedflags-resnet-param-dtype/1"
BF16 = torch.bfloat16


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet18(classes: int = 100) -> nn.Sequential:
    """torchvision's ResNet-18 layout (BasicBlock, [2, 2, 2, 2]), from torch.nn alone."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]  # fmt: skip
    inplanes = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)]
        inplanes = planes
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


Step = Callable[[], float]


def train_variants(batch: int, size: int) -> dict[str, tuple[nn.Module, Step, Any]]:
    """Each training variant: (its model, one step returning the loss, the block it holds)."""
    torch.manual_seed(0)
    start = resnet18().state_dict()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=generator)
    y = torch.randint(0, 100, (batch,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()
    out: dict[str, tuple[nn.Module, Step, Any]] = {}
    for name in ("fp32", "autocast", "param_dtype", "param_dtype per step"):
        net = resnet18()
        net.load_state_dict(start)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        held: Any = contextlib.nullcontext()
        region: Callable[[], Any] = contextlib.nullcontext  # entered around each step
        if name == "autocast":
            region = lambda: torch.autocast("cpu", BF16)  # noqa: E731
        elif name == "param_dtype":
            held = speedflags.fast_math(model=net, param_dtype="bf16")
        elif name == "param_dtype per step":
            spec = speedflags.fast_math(model=net, param_dtype="bf16")
            region = lambda spec=spec: spec  # noqa: E731

        def step(
            net: nn.Module = net, optimizer: Any = optimizer, region: Callable[[], Any] = region
        ) -> float:
            with region():
                loss = loss_fn(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

        out[name] = (net, step, held)
    return out


def infer_variants(batch: int, size: int) -> dict[str, tuple[nn.Module, Step, Any]]:
    torch.manual_seed(0)
    net = resnet18().eval()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2))

    def plain() -> float:
        with torch.inference_mode():
            return float(net(x).sum())

    def autocast() -> float:
        with torch.inference_mode(), torch.autocast("cpu", BF16):
            return float(net(x).sum())

    held = speedflags.fast_math(model=net, param_dtype="bf16")
    return {
        "fp32": (net, plain, contextlib.nullcontext()),
        "autocast": (net, autocast, contextlib.nullcontext()),
        "param_dtype": (net, plain, held),
    }


def check(variants: dict[str, tuple[nn.Module, Step, Any]], steps: int) -> dict[str, Any]:
    """Train each variant a few steps: losses within bf16's reach of autocast's, weights moved."""
    losses: dict[str, list[float]] = {}
    moved: dict[str, bool] = {}
    for name, (net, step, held) in variants.items():
        first = [p.detach().clone() for p in net.parameters()]
        with held:
            losses[name] = [step() for _ in range(steps)]
        moved[name] = all(
            not torch.equal(a, b) for a, b in zip(first, net.parameters(), strict=True)
        )
    reference = losses["autocast"]
    close = {
        name: all(abs(a - b) <= 3e-2 * max(abs(b), 1.0) for a, b in zip(ls, reference, strict=True))
        for name, ls in losses.items()
    }
    return {"losses": losses, "moved": moved, "close_to_autocast": close}


def timed(
    variants: dict[str, tuple[nn.Module, Step, Any]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round; round 0 (warm-up) dropped."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(rounds + 1):
        # each round starts with the next variant: none always follows the same neighbour
        for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
            _, step, held = variants[name]
            with held:
                step()  # the block's first call pays for its casts; the rest is timed
                started = time.perf_counter()
                for _ in range(calls):
                    step()
                elapsed = (time.perf_counter() - started) / calls
            if round_:
                times[name].append(elapsed)
        print(f"round {round_}/{rounds}", file=sys.stderr, flush=True)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    autocast = times["autocast"]
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        ratios = [
            a / v for a, v in zip(autocast, values, strict=True)
        ]  # per round: autocast / variant
        out[name] = {
            "min_ms": min(values) * 1e3,
            "vs_autocast_min": min(autocast) / min(values),
            "median_ms": statistics.median(values) * 1e3,
            "q1_ms": q[0] * 1e3,
            "q3_ms": q[2] * 1e3,
            "vs_autocast": statistics.median(ratios),
            "vs_autocast_rounds": [round(r, 4) for r in ratios],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per variant per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--check-steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", speedflags.SlowPathWarning)  # say it below instead
    caps = speedflags.capabilities("cpu")
    document: dict[str, Any] = {
        "format": FORMAT,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": caps.device,
            "bf16": f"{bool(caps.bf16)}: {caps.bf16.reason}",
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "speedflags": speedflags.__version__,
            "speedflags_path": os.path.dirname(speedflags.__file__),
            # glibc malloc's thresholds: where large blocks are mapped afresh (page faults)
            "malloc_env": {
                name: os.environ.get(name)
                for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
            },
        },
        "workload": {
            "model": "ResNet-18 (torch.nn)",
            "batch": args.batch,
            "size": args.size,
            "rounds": args.rounds,
            "calls": args.calls,
        },
    }
    train = train_variants(args.batch, args.size)
    document["check"] = check(train, args.check_steps)
    train = train_variants(args.batch, args.size)  # fresh copies for the timing
    document["train"] = summary(timed(train, args.rounds, args.calls))
    document["inference"] = summary(timed(infer_variants(args.batch, args.size), args.rounds,
                                          args.calls))  # fmt: skip
    for part in ("train", "inference"):
        for name, row in document[part].items():
            print(f"{part:9} {name:21} median {row['median_ms']:7.1f} ms "
                  f"[{row['q1_ms']:.1f}, {row['q3_ms']:.1f}], {row['vs_autocast']:.3f}x "
                  f"autocast's speed; fastest {row['min_ms']:7.1f} ms, "
                  f"{row['vs_autocast_min']:.3f}x")  # fmt: skip
    check_ = document["check"]
    print("losses close to autocast's:", check_["close_to_autocast"], "weights moved:",
          check_["moved"])  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if not all(check_["moved"].values()) or not all(check_["close_to_autocast"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
