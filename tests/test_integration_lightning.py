"""speedflags.integrations.lightning: real Lightning trainers on the CPU, tiny models.

What each phase's steps see is read with raw torch getters from inside the LightningModule:
the forward (``*_step``), the backward (a tensor hook) and the optimizer step. Every test
also runs under the leak guard of conftest.py, which fails it if any flag changed.
"""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _small_models import Seen, conv_parts, seen_in_forward
from conftest import autocast_enabled, run_example
from torch.utils.data import DataLoader, TensorDataset

import speedflags
from speedflags import InvalidTypeError, InvalidValueError, SpeedflagsError, SpeedflagsWarning
from speedflags.levers import _model_shadow

sf_lightning = pytest.importorskip("speedflags.integrations.lightning")
SpeedFlagsCallback = sf_lightning.SpeedFlagsCallback
# Importing the integration imports every installed flavour (its class subclasses each one's
# Callback); the tests that matter run with each flavour's own Trainer.
FLAVOURS = [name for name in ("lightning.pytorch", "pytorch_lightning") if name in sys.modules]


def seen() -> dict[str, Any]:
    return {
        "precision": torch.get_float32_matmul_precision(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "benchmark": torch.backends.cudnn.benchmark,
        "amp": autocast_enabled("cpu"),
    }


def probe_class(pl: Any) -> Any:
    """A LightningModule of flavour ``pl`` that records the flags in every step, and in the
    backward and the optimizer step of training."""

    class Probe(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, crash_at: int = -1, crash_with: type = RuntimeError) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.log_: list[tuple[str, int, dict[str, Any]]] = []
            self.crash_at = crash_at
            self.crash_with = crash_with
            self.calls = 0

        def record(self, where: str) -> None:
            self.log_.append((where, int(self.current_epoch), seen()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.calls += 1
            if self.calls == self.crash_at:
                raise self.crash_with("crash inside training_step")
            self.record("forward")
            out = self.layer(batch[0].to(self.layer.weight.dtype))
            out.register_hook(lambda grad: self.record("backward"))
            return out.float().pow(2).mean()

        def optimizer_step(
            self, epoch: int, batch_idx: int, optimizer: Any, closure: Any = None
        ) -> None:
            optimizer.step(closure=closure)
            self.record("optimizer")

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.record("between batches")

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.record("validate")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.record("test")

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            self.record("predict")
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Probe


PROBES = {name: probe_class(sys.modules[name]) for name in FLAVOURS}
PL = sys.modules[FLAVOURS[0]]
Probe = PROBES[FLAVOURS[0]]


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


@pytest.fixture(params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def trainer(callback: Any, max_epochs: int = 1, pl: Any = None, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=2,
        limit_val_batches=1,
    )
    options.update(kwargs)
    return (pl or PL).Trainer(callbacks=[callback], **options)


def where(model: Any, name: str) -> list[dict[str, Any]]:
    return [state for at, _, state in model.log_ if at == name]


def test_each_phase_sees_its_levers_inside_its_steps_and_nothing_leaks(flavour: str) -> None:
    cb = SpeedFlagsCallback(
        train={"matmul_precision": "high", "amp": "bf16"},
        validate={"matmul_precision": "medium"},
        test={"cudnn_benchmark": True},
        predict={"amp": "bf16"},
    )
    model = PROBES[flavour]()
    before = speedflags.snapshot()
    t = trainer(cb, pl=sys.modules[flavour], num_sanity_val_steps=1)
    t.fit(model, loader(), loader())
    assert speedflags.snapshot() == before
    t.validate(model, loader(), verbose=False)
    t.test(model, loader(), verbose=False)
    t.predict(model, loader())
    assert speedflags.snapshot() == before

    train = {"precision": "high", "tf32": True, "benchmark": False, "amp": True}
    assert where(model, "forward") == [train] * 2
    assert where(model, "optimizer") == [train] * 2
    # the backward runs in autograd's engine; the process-wide levers hold there too
    assert [s["precision"] for s in where(model, "backward")] == ["high"] * 2
    plain = {"precision": "highest", "tf32": False, "benchmark": False, "amp": False}
    assert where(model, "between batches") == [plain] * 2
    # the sanity check, the validation inside fit, and trainer.validate()
    assert where(model, "validate") == [dict(plain, precision="medium", tf32=True)] * 3
    assert where(model, "test") == [dict(plain, benchmark=True)] * 2
    assert where(model, "predict") == [dict(plain, amp=True)] * 2


def test_the_schedule_switches_at_its_epoch_and_is_recorded(fresh_history: None) -> None:
    # NequIP's shorthand, with the keys as YAML or JSON may give them
    cb = SpeedFlagsCallback(train={"cudnn_benchmark": True}, schedule={"0": True, "2": False})
    model = Probe()
    trainer(cb, max_epochs=4).fit(model, loader())
    by_epoch = {
        epoch: (s["tf32"], s["benchmark"]) for at, epoch, s in model.log_ if at == "forward"
    }
    assert by_epoch == {0: (True, True), 1: (True, True), 2: (False, True), 3: (False, True)}
    switches = [r for r in speedflags.ledger().history if r.action == "switch"]
    assert [(r.reason, r.after) for r in switches] == [
        ("epoch 0: train levers of schedule epoch 0", {"cudnn_benchmark": True, "tf32": True}),
        ("epoch 2: train levers of schedule epoch 2", {"cudnn_benchmark": True, "tf32": False}),
    ]
    assert cb.epoch == 3


def test_a_schedule_from_a_lightning_cli_yaml(tmp_path: Path, flavour: str) -> None:
    pytest.importorskip("jsonargparse")
    cli_module = pytest.importorskip(f"{flavour}.cli")
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            trainer:
              accelerator: cpu
              max_epochs: 3
              logger: false
              enable_checkpointing: false
              enable_progress_bar: false
              enable_model_summary: false
              limit_train_batches: 1
              callbacks:
                - class_path: speedflags.integrations.lightning.SpeedFlagsCallback
                  init_args:
                    train: {matmul_precision: high}
                    validate: {amp: false}
                    schedule:
                      0: {}
                      "1": {matmul_precision: medium, sdpa: [math]}
                      2: {matmul_precision: null}
            """
        )
    )
    cli = cli_module.LightningCLI(
        PROBES[flavour], args=["--config", str(config)], run=False, save_config_callback=None
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SpeedFlagsCallback)]
    assert cb.levers("validate") == {"amp": False}
    cli.trainer.fit(cli.model, loader())
    precision = {epoch: s["precision"] for at, epoch, s in cli.model.log_ if at == "forward"}
    assert precision == {0: "high", 1: "medium", 2: "highest"}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_flags_are_restored_after_a_crash(error: type, flavour: str) -> None:
    cb = SpeedFlagsCallback(train={"matmul_precision": "medium", "amp": "bf16"})
    model = PROBES[flavour](crash_at=2, crash_with=error)
    before = speedflags.snapshot()
    sigint = signal.getsignal(signal.SIGINT)
    # Lightning turns a KeyboardInterrupt into sys.exit(1) after its on_exception hooks
    expected = SystemExit if error is KeyboardInterrupt else error
    try:
        with pytest.raises(expected):
            trainer(cb, pl=sys.modules[flavour]).fit(model, loader())
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C from then on
    assert where(model, "forward")[0]["precision"] == "medium"  # it did hold before the crash
    assert speedflags.snapshot() == before
    assert cb._phases.open_frames == ()


@pytest.mark.parametrize(
    "levers",
    [
        {"train": {"tf32": True}},
        {"schedule": {0: False, 5: True}},
        {"validate": {"tf32": True}},
    ],
)
def test_tf32_with_float64_parameters_is_refused_before_any_step(levers: dict[str, Any]) -> None:
    model = Probe().double()
    with pytest.raises(SpeedflagsError, match="float64 parameters") as info:
        trainer(SpeedFlagsCallback(**levers), num_sanity_val_steps=1).fit(model, loader(), loader())
    assert isinstance(info.value, InvalidValueError)
    assert model.log_ == []
    # without TF32 a float64 model trains
    trainer(SpeedFlagsCallback(train={"cudnn_benchmark": True})).fit(model, loader())


def test_a_resumed_fit_continues_the_schedule(tmp_path: Path, fresh_history: None) -> None:
    schedule = {0: {"matmul_precision": "high"}, 2: {"matmul_precision": "medium"}}
    first = SpeedFlagsCallback(schedule=schedule)
    t = trainer(first, max_epochs=2)
    t.fit(Probe(), loader())
    path = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    assert list(saved.values()) == [{"epoch": 1, "schedule_epoch": 0}]

    speedflags.ledger().clear_history()
    second = SpeedFlagsCallback(schedule=schedule)
    model = Probe()
    trainer(second, max_epochs=4).fit(model, loader(), ckpt_path=path)
    precision = {epoch: s["precision"] for at, epoch, s in model.log_ if at == "forward"}
    assert precision == {2: "medium", 3: "medium"}
    # the loaded state says entry 0 was active: the switch to entry 2 is recorded from it
    (switch,) = [r for r in speedflags.ledger().history if r.action == "switch"]
    assert (switch.before, switch.after) == (
        {"matmul_precision": "high"},
        {"matmul_precision": "medium"},
    )


def test_a_precision_plugin_that_autocasts_is_warned_about() -> None:
    cb = SpeedFlagsCallback(train={"amp": "bf16"})
    model = Probe()
    with pytest.warns(SpeedflagsWarning, match=r"precision plugin \(precision='bf16-mixed'\)"):
        trainer(cb, precision="bf16-mixed").fit(model, loader())
    assert where(model, "forward")[0]["amp"] is True


def test_every_rank_is_checked_under_a_process_group(tmp_path: Path, fresh_history: None) -> None:
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip(f"PyTorch {torch.__version__} is built without torch.distributed")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        trainer(SpeedFlagsCallback(train={"matmul_precision": "high"})).fit(Probe(), loader())
    finally:
        dist.destroy_process_group()
    checks = [r.reason for r in speedflags.ledger().history if r.lever == "ranks"]
    assert checks == ["all 1 ranks agree (gloo)"]


def test_bad_arguments_name_the_callback_argument() -> None:
    with pytest.raises(
        InvalidValueError, match=r"SpeedFlagsCallback\(validate=\{'amp': 'bf17'\}\)"
    ):
        SpeedFlagsCallback(validate={"amp": "bf17"})
    with pytest.raises(InvalidTypeError, match=r"SpeedFlagsCallback\(test=True\): expected a dict"):
        SpeedFlagsCallback(test=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match=r"schedule=\{'-3': \.\.\.\}\)"):
        SpeedFlagsCallback(schedule={"-3": True})
    with pytest.raises(InvalidValueError, match="contradictory"):
        SpeedFlagsCallback(train={"matmul_precision": "high"}, schedule={4: False})


# --- the model levers per phase -----------------------------------------------------------


def conv_class(pl: Any) -> Any:
    """A LightningModule of flavour ``pl`` (convolution, BatchNorm, Linear) that records, in
    its forward, the dtype and layout its convolution computes with, and autocast's state."""

    class ConvProbe(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, save_to: Path | None = None) -> None:
            super().__init__()
            self.conv, self.norm, self.head = conv_parts(4 * 4)
            self.seen: list[Seen] = []
            self.losses: list[float] = []
            self.save_to = save_to

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # inside forward the weight is the cast, under param_dtype
            self.seen.append(seen_in_forward(self.training, self.conv.weight))
            h = torch.relu(self.norm(self.conv(x)))
            return self.head(h.flatten(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))
            if self.save_to is not None:  # a checkpoint saved while the phase's levers hold
                self.trainer.save_checkpoint(self.save_to / "inside_validate.ckpt")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self(batch[0])

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return ConvProbe


CONV_PROBES = {name: conv_class(sys.modules[name]) for name in FLAVOURS}


def image_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 4, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.mean((1, 2, 3)).unsqueeze(1)), batch_size=4)


def test_model_levers_per_phase_act_on_the_lightning_module(tmp_path: Path, flavour: str) -> None:
    cb = SpeedFlagsCallback(
        train={"amp": "bf16"},
        validate={"param_dtype": "bf16", "memory_format": "channels_last"},
        test={"param_dtype": "bf16"},
        predict={"memory_format": "channels_last"},
    )
    model = CONV_PROBES[flavour](save_to=tmp_path)
    before = speedflags.snapshot()
    t = trainer(cb, pl=sys.modules[flavour], max_epochs=2, num_sanity_val_steps=1)
    t.fit(model, image_loader(), image_loader())
    t.test(model, image_loader(), verbose=False)
    predictions = t.predict(model, image_loader())
    assert speedflags.snapshot() == before
    assert not any(_model_shadow.shadowed(m) for m in model.modules())
    assert all(p.dtype == torch.float32 and p.is_contiguous() for p in model.parameters())

    f32, bf16 = torch.float32, torch.bfloat16
    by_phase: dict[tuple[str, Any, bool, bool], int] = {}
    for seen_ in model.seen:
        by_phase[seen_] = by_phase.get(seen_, 0) + 1
    # training under autocast with the float32 weights; validation (the sanity check and
    # two epochs) with bf16 casts in channels_last; test in bf16; predict in channels_last
    assert by_phase == {
        ("train", f32, False, True): 4,
        ("eval", bf16, True, False): 1 + 2,  # the sanity check, then one batch per epoch
        ("eval", bf16, False, False): 2,
        ("eval", f32, True, False): 2,
    }
    assert all(p.dtype == f32 for p in predictions)
    assert len(set(model.losses)) == len(model.losses)  # it trained

    checkpoint = torch.load(tmp_path / "inside_validate.ckpt", weights_only=False)
    tensors = checkpoint["state_dict"]
    assert tensors and all(
        t.dtype in (f32, torch.int64) and t.is_contiguous() for t in tensors.values()
    )


def test_param_dtype_for_training_with_a_fused_optimizer_trains(flavour: str) -> None:
    class Fused(CONV_PROBES[flavour]):  # type: ignore[misc, valid-type]
        def configure_optimizers(self) -> Any:
            options = {"fused": True} if _has_fused_cpu() else {}
            return torch.optim.AdamW(self.parameters(), lr=1e-2, **options)

    model = Fused()
    cb = SpeedFlagsCallback(train={"param_dtype": "bf16"})
    trainer(cb, pl=sys.modules[flavour], max_epochs=3).fit(model, image_loader())
    assert {seen_[1] for seen_ in model.seen} == {torch.bfloat16}
    assert len(set(model.losses)) == len(model.losses) == 6


def _has_fused_cpu() -> bool:
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], fused=True)
    except RuntimeError:  # PyTorch 2.1: CUDA only
        return False
    return True


def test_model_levers_in_a_phase_are_validated_when_the_callback_is_built() -> None:
    with pytest.raises(InvalidValueError, match=r"SpeedFlagsCallback\(validate=.*'bf17'"):
        SpeedFlagsCallback(validate={"param_dtype": "bf17"})
    cb = SpeedFlagsCallback(validate={"memory_format": "channels_last"})
    assert cb.levers("validate") == {"memory_format": "channels_last"}


def test_the_model_levers_example_runs(tmp_path: Path) -> None:
    run_example(
        "lightning_model_levers.py", tmp_path,
        "validation loss with bf16 casts in channels_last: ",
        "checkpoint saved by Lightning: float32 and contiguous: yes",
        "model's own classes, dtypes and layouts after the run: yes",
    )  # fmt: skip
