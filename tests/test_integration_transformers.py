"""speedflags.integrations.transformers: real Hugging Face Trainers on the CPU, a tiny model.

The model's forward and the optimizer's step read the flags with raw torch getters. Every
test also runs under the leak guard of conftest.py, which fails it if any flag changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _small_models import Seen, conv_parts, seen_in_forward
from conftest import autocast_enabled, needs_new_api, run_example

import speedflags
from speedflags import InvalidValueError, SpeedflagsWarning
from speedflags.levers import _model_shadow

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure of it
sf_transformers = pytest.importorskip("speedflags.integrations.transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
transformers = pytest.importorskip("transformers")
SpeedFlagsCallback = sf_transformers.SpeedFlagsCallback

Log = list[tuple[str, dict[str, Any]]]


def seen() -> dict[str, Any]:
    return {
        "precision": torch.get_float32_matmul_precision(),  # raises in a mixed TF32 state
        "benchmark": torch.backends.cudnn.benchmark,
        "amp": autocast_enabled("cpu"),
    }


class Probe(torch.nn.Module):
    def __init__(self, log: Log, crash_at: int = -1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.log = log
        self.crash_at = crash_at
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("crash inside forward")
        self.log.append(("train" if self.training else "eval", seen()))
        out = self.layer(x.to(self.layer.weight.dtype)).float().squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), float(i)), "labels": torch.tensor(float(i))}


def make_trainer(tmp_path: Path, model: Probe, callbacks: Any = None, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    options.update(kwargs)
    log = model.log

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            log.append(("optimizer", seen()))
            return super().step(closure)

    return transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**options),
        train_dataset=Data(),
        eval_dataset=Data(),
        callbacks=callbacks,
        optimizers=(RecordingSGD(model.parameters(), lr=1e-3), None),
    )


def phases(log: Log) -> list[tuple[str, str, bool, bool]]:
    return [(at, s["precision"], s["benchmark"], s["amp"]) for at, s in log]


def test_train_and_evaluate_levers_hold_in_their_steps_and_nothing_leaks(tmp_path: Path) -> None:
    log: Log = []
    cb = SpeedFlagsCallback(
        train={"matmul_precision": "medium", "amp": "bf16"}, evaluate={"cudnn_benchmark": True}
    )
    trainer = make_trainer(
        tmp_path, Probe(log), [cb], eval_strategy="steps", eval_steps=1, eval_on_start=True
    )
    before = speedflags.snapshot()
    trainer.evaluate()  # standalone, before any train(): attached when the Trainer was built
    assert speedflags.snapshot() == before
    trainer.train()
    assert speedflags.snapshot() == before
    trainer.predict(Data())
    assert speedflags.snapshot() == before

    train = ("medium", False, True)
    evaluate = ("highest", True, False)
    assert phases(log) == [
        *[("eval", *evaluate)] * 2,  # evaluate(): 8 samples, batches of 4
        *[("eval", *evaluate)] * 2,  # eval_on_start
        *[("train", *train), ("optimizer", *train), ("eval", *evaluate), ("eval", *evaluate)] * 2,
        *[("eval", *evaluate)] * 2,  # predict()
    ]


def test_flags_are_restored_when_a_training_step_raises(tmp_path: Path) -> None:
    log: Log = []
    cb = SpeedFlagsCallback(train={"matmul_precision": "high", "cudnn_benchmark": True})
    trainer = make_trainer(tmp_path, Probe(log, crash_at=2), [cb])
    before = speedflags.snapshot()
    with pytest.raises(RuntimeError, match="crash inside forward"):
        trainer.train()
    assert phases(log)[0] == ("train", "high", True, False)  # the levers held before the crash
    assert speedflags.snapshot() == before
    assert cb._phases.open_frames == ()


@pytest.fixture
def tf32_args(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let ``TrainingArguments(tf32=True)`` run its real TF32 write on this CPU.

    It refuses TF32 without an Ampere GPU, which a CPU build cannot show: only that check is
    faked. Its writer, ``enable_tf32``, is ``lru_cache``d: cleared so that it writes again.
    """
    import transformers.training_args as training_args
    from transformers.utils.import_utils import enable_tf32

    monkeypatch.setattr(training_args, "is_torch_tf32_available", lambda: True)
    enable_tf32.cache_clear()
    yield
    enable_tf32.cache_clear()


@needs_new_api
def test_the_mixed_tf32_state_of_training_arguments_is_healed(
    tmp_path: Path, tf32_args: None, raw_tf32: None
) -> None:
    log: Log = []
    cb = SpeedFlagsCallback(train={"cudnn_benchmark": True})
    trainer = make_trainer(tmp_path, Probe(log), [cb], tf32=True)
    # what TrainingArguments(tf32=True) leaves on PyTorch >= 2.9: the new API alone
    assert torch.backends.fp32_precision == "tf32"
    assert not speedflags.tf32_status().consistent
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    before = speedflags.snapshot()

    with pytest.warns(SpeedflagsWarning, match="healed a mixed TF32 state") as warned:
        trainer.train()
    assert "TrainingArguments(tf32=...)" in str(warned[0].message)
    assert [at for at, _ in log] == ["train", "optimizer"] * 2
    assert all(s["precision"] == "high" and s["benchmark"] for _, s in log)
    # healed and kept: consistent, TF32 still what kernels used; every other lever restored
    status = speedflags.tf32_status()
    assert status.consistent and status.effective["cublas_matmul_tf32"]
    after = speedflags.snapshot()
    assert {k: v for k, v in after.items() if k not in ("tf32", "matmul_precision")} == {
        k: v for k, v in before.items() if k not in ("tf32", "matmul_precision")
    }
    assert [r.action for r in speedflags.ledger().history if r.lever == "tf32"][-1:] == ["heal"]


def test_a_callback_added_later_warns_until_attached(tmp_path: Path) -> None:
    log: Log = []
    cb = SpeedFlagsCallback(evaluate={"cudnn_benchmark": True})
    trainer = make_trainer(tmp_path, Probe(log))
    trainer.add_callback(cb)
    with pytest.warns(SpeedflagsWarning, match="without the evaluate levers"):
        trainer.evaluate()
    assert cb.attach(trainer) is trainer
    assert cb.attach(trainer) is trainer  # idempotent: one wrapper
    trainer.evaluate()
    assert [s["benchmark"] for _, s in log] == [False, False, True, True]


def test_a_callback_added_later_finds_its_trainer_when_training_begins(tmp_path: Path) -> None:
    log: Log = []
    cb = SpeedFlagsCallback(train={"cudnn_benchmark": True}, evaluate={"amp": "bf16"})
    trainer = make_trainer(tmp_path, Probe(log), eval_strategy="steps", eval_steps=2)
    trainer.add_callback(cb)
    trainer.train()
    assert [(at, s["benchmark"], s["amp"]) for at, s in log] == [
        *[("train", True, False), ("optimizer", True, False)] * 2,
        *[("eval", False, True)] * 2,
    ]


def test_tf32_with_a_float64_model_is_refused_before_any_step(tmp_path: Path) -> None:
    log: Log = []
    model = Probe(log).double()
    trainer = make_trainer(tmp_path, model, [SpeedFlagsCallback(train={"tf32": True})])
    with pytest.raises(InvalidValueError, match="float64 parameters"):
        trainer.train()
    assert log == []


def test_bad_arguments_name_the_callback_argument() -> None:
    with pytest.raises(InvalidValueError, match=r"SpeedFlagsCallback\(evaluate=\{'amp': 'fp8'\}\)"):
        SpeedFlagsCallback(evaluate={"amp": "fp8"})
    with pytest.raises(TypeError, match=r"SpeedFlagsCallback\(train=\['tf32'\]\): expected a dict"):
        SpeedFlagsCallback(train=["tf32"])


# --- the model levers per phase -----------------------------------------------------------


class ConvProbe(torch.nn.Module):
    """A convolution, BatchNorm and a Linear head; records in its forward the dtype and layout
    its convolution computes with, and whether autocast is on."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = conv_parts(2 * 2)
        self.seen: list[Seen] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        # inside forward the weight is the cast, under param_dtype
        self.seen.append(seen_in_forward(self.training, self.conv.weight))
        h = torch.relu(self.norm(self.conv(x.view(-1, 1, 2, 2).expand(-1, 3, 2, 2))))
        out = self.head(h.flatten(1)).squeeze(-1)
        loss = (out.float() - labels).pow(2).mean()
        if self.training:
            self.losses.append(loss.item())
        return {"loss": loss, "logits": out}


def test_model_levers_per_phase_act_on_the_trainers_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = ConvProbe()
    saved: list[Path] = []

    def save_inside_evaluation(prediction: Any) -> dict[str, float]:
        # compute_metrics runs inside the evaluation loop, with its levers held
        trainer.save_model(str(tmp_path / "inside_evaluate"))
        saved.append(tmp_path / "inside_evaluate" / "model.safetensors")
        return {}

    cb = SpeedFlagsCallback(
        train={"param_dtype": "bf16"},
        evaluate={"param_dtype": "bf16", "memory_format": "channels_last"},
    )
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
            per_device_eval_batch_size=4, report_to="none", save_strategy="steps", save_steps=2,
            logging_strategy="no", use_cpu=True, disable_tqdm=True, eval_strategy="steps",
            eval_steps=2,
        ),
        train_dataset=Data(),
        eval_dataset=Data(),
        callbacks=[cb],
        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-2), None),
        compute_metrics=save_inside_evaluation,
    )  # fmt: skip
    before = speedflags.snapshot()
    trainer.train()
    assert speedflags.snapshot() == before
    assert not any(_model_shadow.shadowed(m) for m in model.modules())
    bf16 = torch.bfloat16
    assert {s for s in model.seen if s[0] == "train"} == {("train", bf16, False, False)}
    assert {s for s in model.seen if s[0] == "eval"} == {("eval", bf16, True, False)}
    assert len(set(model.losses)) == len(model.losses) == 4  # trained at every step
    checkpoints = sorted((tmp_path / "out").glob("checkpoint-*/model.safetensors"))
    assert len(checkpoints) == 2 and saved
    for path in [*checkpoints, saved[-1]]:
        tensors = load_file(str(path))
        assert tensors and all(
            t.dtype in (torch.float32, torch.int64) and t.is_contiguous() for t in tensors.values()
        ), path


def test_model_levers_in_a_phase_are_validated_when_the_callback_is_built() -> None:
    with pytest.raises(InvalidValueError, match=r"SpeedFlagsCallback\(evaluate=.*'nhwc'"):
        SpeedFlagsCallback(evaluate={"memory_format": "nhwc"})
    assert SpeedFlagsCallback(train={"param_dtype": "bf16"}).levers("train") == {
        "param_dtype": "bf16"
    }


def test_the_model_levers_example_runs(tmp_path: Path) -> None:
    run_example(
        "hf_model_levers.py", tmp_path,
        "evaluation loss with bf16 casts: ",
        "2 checkpoints saved by the Trainer: float32: yes",
        "model's own classes after the run: yes",
    )  # fmt: skip
