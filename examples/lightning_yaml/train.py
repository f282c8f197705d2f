"""LightningCLI with speedflags' ``SpeedFlagsCallback`` configured in YAML, schedule included.

``config.yaml`` (next to this script) sets the callback with ``class_path``/``init_args``:
``train`` levers around each training batch, full-precision validation, and NequIP's TF32
schedule (on from epoch 0, off from epoch 4). The script fits the same model from the same
weights with plain fp32 levers in place of the configured callback and with the configured
one (or, with ``--levers``, a callback of those levers), in interleaved passes (one fit each:
fp32, levers, fp32, ...), each timed from its second epoch (the first is its warm-up). It
prints the time per training batch of each and the speedup with its noise (or, where the
levers change nothing on the device, says so instead), the schedule switches from the
ledger's history, and checks that every flag ends as it began.

    python examples/lightning_yaml/train.py --config examples/lightning_yaml/config.yaml
    python examples/lightning_yaml/train.py --levers tf32=true,amp=bf16
    python examples/lightning_yaml/train.py --smoke      # tiny sizes on a CPU (CI)

``--passes N`` sets the passes; other arguments go to LightningCLI
(``--trainer.max_epochs=10``, ``--model.width=256``).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/_common.py
from _common import (
    FP32,
    Progress,
    flags_as_found,
    interleaved,
    parse_levers,
    passes,
    speedup_line,
    sync,
)

import speedflags
from speedflags.integrations.lightning import SpeedFlagsCallback

try:
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI
except ModuleNotFoundError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.cli import LightningCLI  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
SMOKE = [
    "--trainer.max_epochs=5",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.accelerator=cpu",
    "--model.width=16",
    "--model.depth=1",
    "--data.batch_size=8",
    "--data.num_batches=3",
]


class ToyModel(pl.LightningModule):
    """An MLP regressor: wide float32 matmuls, where TF32 and bf16 pay."""

    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ToyData(pl.LightningDataModule):
    """Synthetic regression data (nothing to download)."""

    def __init__(self, batch_size: int = 64, num_batches: int = 20) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size * num_batches, 64, generator=generator)
        self.data = TensorDataset(x, x[:, :1].sin())
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class BatchTimer(pl.Callback):
    """Time per training batch (forward, backward, optimizer step), from the second epoch on
    (the first pays one-time costs), with progress lines."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.times: list[float] = []
        self.batches = 0
        self.start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        sync(module.device)
        self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sync(module.device)
        seconds = time.perf_counter() - self.start
        if trainer.current_epoch > 0 or trainer.max_epochs == 1:
            self.times.append(seconds)
        self.batches += 1
        total = int(trainer.estimated_stepping_batches)
        if self.batches == 1:
            self.progress.first(seconds, total - 1)
        else:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.progress.step(self.batches - 1, total - 1, loss)

    @property
    def seconds(self) -> float:
        return sum(self.times) / max(len(self.times), 1)


def _ours(argv: list[str]) -> tuple[list[str], bool, dict[str, Any] | None, int | None]:
    """``--smoke``, ``--levers X`` and ``--passes N`` taken out of ``argv``; the rest goes
    to LightningCLI."""
    rest: list[str] = []
    smoke, levers, count = False, None, None
    items = iter(argv)
    for arg in items:
        name, sep, value = arg.partition("=")
        if arg == "--smoke":
            smoke = True
        elif name in ("--levers", "--passes"):
            value = value if sep else next(items, "")
            if name == "--levers":
                levers = parse_levers(value)
            else:
                count = int(value)
        else:
            rest.append(arg)
    return rest, smoke, levers, count


def main() -> None:
    argv, smoke, given, count = _ours(sys.argv[1:])
    count = passes(count, smoke)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", str(HERE / "config.yaml"), *argv]
    if smoke:
        argv += SMOKE
    sys.argv = sys.argv[:1]  # everything goes through args=; LightningCLI warns about both
    cli = LightningCLI(ToyModel, ToyData, run=False, args=argv, save_config_callback=None)
    (configured,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, SpeedFlagsCallback)]
    if given is not None:  # --levers: a callback of those levers in place of the configured one
        configured = SpeedFlagsCallback(train=given, validate={"amp": False})
    print(f"levers: {configured!r}; {count} interleaved passes (one fit each)")

    with flags_as_found():
        start = copy.deepcopy(cli.model.state_dict())
        left = [2 * count]

        def fit(callback: SpeedFlagsCallback, label: str) -> float:
            cli.model.load_state_dict(start)
            timer = BatchTimer(Progress(label, left[0]))
            left[0] -= 1
            cli.instantiate_trainer(callbacks=[callback, timer]).fit(
                cli.model, datamodule=cli.datamodule
            )
            return timer.seconds

        plain = SpeedFlagsCallback(train=FP32, validate=FP32)
        speedflags.ledger().clear_history()
        times = interleaved(
            {
                "fp32": lambda label: fit(plain, label),
                "speedflags": lambda label: fit(configured, label),
            },
            count,
        )
        switches = [r for r in speedflags.ledger().history if r.action == "switch"]
        for record in switches[: len(switches) // count]:  # the first fit's (each fit's alike)
            print(f"schedule: {record.reason}: {record.after}")
        levers: dict[str, Any] = configured.levers("train")
        name = "Lightning MLP (from epoch 1, across the schedule)"
        device = next(cli.model.parameters()).device
        print(speedup_line(name, times, levers, device, smoke))


if __name__ == "__main__":
    main()
