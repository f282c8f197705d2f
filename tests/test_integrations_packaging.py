"""The integrations are optional: ``import speedflags`` never imports their libraries, each
integration says which extra it needs, and the Lightning one works with either flavour.

A library is hidden by putting ``None`` in ``sys.modules`` (``import`` then raises
``ModuleNotFoundError``) and the integration is imported afresh; the fixture puts all back.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import speedflags.integrations
from speedflags.integrations import _phases

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("lightning", "pytorch_lightning", "transformers", "accelerate", "jsonargparse")


def test_import_speedflags_imports_no_integration_library() -> None:
    code = (
        "import sys, speedflags, speedflags.integrations, speedflags.integrations._phases\n"
        f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def reimport(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, tuple], Any]]:
    """Import an integration afresh with some libraries hidden; put everything back after."""
    touched: dict[str, Any] = {}
    missing = object()

    def run(name: str, hidden: tuple) -> Any:
        for module in hidden:
            monkeypatch.setitem(sys.modules, module, None)
        short = name.rsplit(".", 1)[1]
        if name not in touched:
            attribute = getattr(speedflags.integrations, short, missing)
            touched[name] = (sys.modules.get(name, missing), short, attribute)
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    yield run
    for name, (module, short, attribute) in touched.items():
        if module is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
        if attribute is missing:
            vars(speedflags.integrations).pop(short, None)
        else:
            setattr(speedflags.integrations, short, attribute)


def test_lightning_without_lightning_names_the_extra(reimport: Any) -> None:
    hidden = ("lightning", "lightning.pytorch", "pytorch_lightning")
    with pytest.raises(ImportError, match=r"pip install 'speedflags\[lightning\]'"):
        reimport("speedflags.integrations.lightning", hidden)


def test_transformers_without_transformers_names_the_extra(reimport: Any) -> None:
    with pytest.raises(ImportError, match=r"pip install 'speedflags\[transformers\]'"):
        reimport("speedflags.integrations.transformers", ("transformers",))


@pytest.mark.parametrize(
    ("flavour", "hidden"),
    [
        ("pytorch_lightning", ("lightning", "lightning.pytorch")),
        ("lightning.pytorch", ("pytorch_lightning",)),
    ],
)
def test_lightning_with_one_flavour_only(reimport: Any, flavour: str, hidden: tuple) -> None:
    pl = pytest.importorskip(flavour)
    module = reimport("speedflags.integrations.lightning", hidden)
    callback = module.SpeedFlagsCallback(train={"matmul_precision": "high"})
    assert module.SpeedFlagsCallback.__bases__ == (pl.Callback,)
    seen = []

    class Model(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(torch.get_float32_matmul_precision())
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)))
    trainer = pl.Trainer(
        callbacks=callback,  # a single callback: the Trainer checks isinstance(.., Callback)
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), data)
    assert seen == ["high", "high"]


def test_a_phase_without_levers_opens_no_frame() -> None:
    frames = _phases.PhaseFrames("cb", {"train": {}, "validate": {"cudnn_benchmark": True}})
    assert frames.open("train", torch.device("cpu")) is None
    frame = frames.open("validate", torch.device("cpu"))
    assert frame is not None and torch.backends.cudnn.benchmark
    frames.close_all()
    assert frame.closed and not torch.backends.cudnn.benchmark


def test_an_unsupported_device_is_refused_with_the_phase_named() -> None:
    frames = _phases.PhaseFrames("cb", {"train": {"amp": "bf16"}})
    with pytest.raises(ValueError, match=r"cb: train levers on meta: .*'cpu' and 'cuda'"):
        frames.open("train", torch.device("meta"))


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML is not installed")
def test_yaml_gives_nequip_schedules_as_the_callbacks_take_them() -> None:
    import yaml

    given = yaml.safe_load("schedule: {0: true, '100': false, 200: {amp: bf16}}")["schedule"]
    entries = _phases.schedule_entries("cb", given, {"cudnn_benchmark": True})
    assert [(epoch, merged) for epoch, _, merged in entries] == [
        (0, {"cudnn_benchmark": True, "tf32": True}),
        (100, {"cudnn_benchmark": True, "tf32": False}),
        (200, {"cudnn_benchmark": True, "amp": "bf16"}),
    ]


def test_phase_frames_pickle_without_their_specs_and_frames() -> None:
    frames = _phases.PhaseFrames("cb", {"train": {"cudnn_benchmark": True}})
    frames.open("train", torch.device("cpu"))
    try:
        copied = pickle.loads(pickle.dumps(frames))  # noqa: S301 - the cached spec holds a lock
    finally:
        frames.close_all()
    assert copied.open_frames == () and copied.levers("train") == {"cudnn_benchmark": True}
    copied.open("train", torch.device("cpu"))
    assert torch.backends.cudnn.benchmark
    copied.close_all()
