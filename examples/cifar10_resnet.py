"""Train a ResNet on CIFAR-10-shaped images, in fp32 and then with speedflags' levers.

Images come from a local CIFAR-10 copy through torchvision (``--data PATH``, the folder that
holds ``cifar-10-batches-py``; nothing is ever downloaded) or, without ``--data``, are
synthetic. The same training steps run in plain fp32 and with the levers recommended for the
device plus ``cudnn_benchmark=True`` (a fixed-shape convolutional network is where cuDNN's
autotuning pays), or those given with ``--levers``, in interleaved passes (fp32, levers, fp32,
...), each with a warm-up step of its own. It prints the time per step of each and the
speedup with its noise (or, where the levers change nothing on the device, as cuDNN's
autotuning on a CPU, says so instead), and checks that every flag ends as it began.

    python examples/cifar10_resnet.py --data ~/datasets/cifar10   # for real (CUDA if available)
    python examples/cifar10_resnet.py --smoke                      # tiny sizes on a CPU (CI)
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Iterator
from itertools import cycle
from pathlib import Path
from typing import Any

import _common as common
import torch
from torch import nn

import speedflags

Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-18's layout for 32x32 images (a 3x3 stem, no max-pool), at a chosen width."""

    def __init__(self, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(Block(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def batches(data: Path | None, batch: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` batches on ``device``: from a local CIFAR-10 copy, or synthetic."""
    if data is None:
        generator = torch.Generator().manual_seed(0)
        return [
            (torch.randn(batch, 3, 32, 32, generator=generator).to(device),
             torch.randint(0, 10, (batch,), generator=generator).to(device))
            for _ in range(count)
        ]  # fmt: skip
    if importlib.util.find_spec("torchvision") is None:
        raise SystemExit(
            "--data needs torchvision (pip install torchvision); omit --data for synthetic images"
        )
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.491, 0.482, 0.447), (0.247, 0.243, 0.262))]
    )
    dataset = datasets.CIFAR10(str(data), train=True, download=False, transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
    out: list[Batch] = []
    for images, labels in loader:  # preloaded, so both runs time the same compute
        out.append((images.to(device), labels.to(device)))
        if len(out) == count:
            break
    return out


def make_step(
    model: nn.Module, amp: Any, device: torch.device, data: Iterator[Batch]
) -> Callable[[], torch.Tensor]:
    optimizer = speedflags.training.fast_optimizer(
        torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9
    )
    scaler = speedflags.training.grad_scaler(amp, device=device)  # on for fp16 only

    def step() -> torch.Tensor:
        images, labels = next(data)
        logits = model(images.contiguous(memory_format=torch.channels_last))
        loss = nn.functional.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()  # read (a device sync) only when progress is printed

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    parser.add_argument("--data", type=Path, default=None, help="a local CIFAR-10 folder")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    device = common.pick_device(args.device, args.smoke)
    width, batch, steps = (8, 8, 3) if args.smoke else (64, 256, 6)
    count = common.passes(args.passes, args.smoke)
    steps = args.steps or steps
    levers = common.chosen_levers(args.levers, device, args.config, cudnn_benchmark=True)
    data = batches(args.data, batch, steps + 1, device)
    print(f"device: {speedflags.capabilities(device).device}; data: {args.data or 'synthetic'}")
    print(
        f"{count} interleaved passes of {steps} steps, fp32 then the levers: each pass says how "
        "long it will take after its first timed step (full size: minutes on a CPU, seconds on a "
        "GPU)",
        flush=True,
    )

    with common.flags_as_found():
        runs = {}
        left = [2 * count]  # passes left to run, of both configurations
        for name, setting in (("fp32", common.FP32), ("speedflags", levers)):
            torch.manual_seed(0)
            model = ResNet(width).to(device).to(memory_format=torch.channels_last)
            step = make_step(model, setting.get("amp", False), device, cycle(data))
            spec = speedflags.fast_math(device=device, **setting)
            runs[name] = common.timed_pass(spec, step, steps, device, left)
        times = common.interleaved(runs, count)
        print(common.speedup_line("CIFAR-10 ResNet", times, levers, device, args.smoke))


if __name__ == "__main__":
    main()
