"""Lightning: train under autocast, validate with bf16 casts of the float32 weights in
channels_last, through ``SpeedFlagsCallback``'s per-phase model levers.

A small convolutional regressor (convolution, BatchNorm, Linear) fits a few epochs with
``SpeedFlagsCallback(train={"amp": "auto"}, validate={"param_dtype": "bf16", "memory_format":
"channels_last"})`` and a ``ModelCheckpoint``. Afterwards the script validates once more in
float32 to compare, loads the checkpoint Lightning saved during the run and shows that it is
an ordinary float32 checkpoint (every tensor float32 and contiguous), checks that the model's
classes and layouts are its own again, and that every flag ends as it began.

    python examples/lightning_model_levers.py            # a few epochs on the CPU
    python examples/lightning_model_levers.py --smoke    # tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_common.py
from _common import flags_as_found

from speedflags.integrations.lightning import SpeedFlagsCallback

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
except ModuleNotFoundError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef]


class ConvRegressor(pl.LightningModule):
    """Predicts each image's mean brightness: convolutions, BatchNorm, a Linear head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def images(count: int, size: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(count, 3, size, size, generator=generator)
    return DataLoader(TensorDataset(x, x.mean((1, 2, 3)).unsqueeze(1)), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args()
    width, size, count, epochs = (8, 8, 32, 2) if args.smoke else (32, 32, 512, 5)
    torch.manual_seed(0)
    model = ConvRegressor(width)
    callback = SpeedFlagsCallback(
        train={"amp": "auto"},  # bf16 autocast where the device has native bf16
        validate={"param_dtype": "bf16", "memory_format": "channels_last"},
    )
    with flags_as_found(), tempfile.TemporaryDirectory() as out:
        checkpoints = ModelCheckpoint(dirpath=out, save_last=True)
        trainer = pl.Trainer(
            max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[callback, checkpoints], default_root_dir=out,
        )  # fmt: skip
        trainer.fit(model, images(count, size, 0), images(count // 2, size, 1))
        bf16_loss = float(trainer.callback_metrics["val_loss"])
        plain = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False)  # fmt: skip
        (fp32,) = plain.validate(model, images(count // 2, size, 1), verbose=False)
        print(f"validation loss with bf16 casts in channels_last: {bf16_loss:.5f}")
        print(f"validation loss in float32:                      {fp32['val_loss']:.5f}")

        state = torch.load(Path(out) / "last.ckpt", weights_only=False)["state_dict"]
        ordinary = all(
            t.dtype in (torch.float32, torch.int64) and t.is_contiguous() for t in state.values()
        )
        print(
            f"checkpoint saved by Lightning: float32 and contiguous: {'yes' if ordinary else 'NO'}"
        )
        own = all("_speedflags_own_class" not in type(m).__dict__ for m in model.modules())
        layout = all(p.is_contiguous() and p.dtype == torch.float32 for p in model.parameters())
        kept = "yes" if own and layout else "NO"
        print(f"model's own classes, dtypes and layouts after the run: {kept}")
        if not (ordinary and own and layout):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
