"""grad_scaler, fast_optimizer, to_device, and a full small training loop under @speedup."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from conftest import CPU_AUTOCAST_FP16
from torch.utils import _foreach_utils

import speedflags
from speedflags import InvalidTypeError, InvalidValueError
from speedflags.training import fast_optimizer, grad_scaler, to_device


def last_record(lever: str) -> Any:
    return [r for r in speedflags.ledger().history if r.lever == lever][-1]


# PyTorch 2.3 added torch.amp.GradScaler (any device type); before, torch.cuda.amp's only
AMP_SCALER = getattr(torch.amp, "GradScaler", None)
needs_amp_scaler = pytest.mark.skipif(
    AMP_SCALER is None, reason=f"PyTorch {torch.__version__} has no torch.amp.GradScaler"
)
FUSED_DEVICES = _foreach_utils._get_fused_kernels_supported_devices()
needs_fused_cpu = pytest.mark.skipif(
    "cpu" not in FUSED_DEVICES,
    reason=f"PyTorch {torch.__version__} fuses optimizers on {', '.join(FUSED_DEVICES)} only "
    "(torch.utils._foreach_utils._get_fused_kernels_supported_devices)",
)
needs_fused_sgd = pytest.mark.skipif(
    "fused" not in inspect.signature(torch.optim.SGD).parameters,
    reason=f"PyTorch {torch.__version__}'s SGD has no fused= argument",
)


# --- grad_scaler ------------------------------------------------------------------------


@pytest.mark.parametrize("amp", ["bf16", torch.bfloat16, False])
def test_scaler_is_a_pass_through_without_fp16(amp: Any) -> None:
    scaler = grad_scaler(amp, device="cpu")
    # before torch.amp.GradScaler, the CUDA one: disabled, a pass-through on any device
    assert isinstance(scaler, AMP_SCALER or torch.cuda.amp.GradScaler)
    assert scaler.is_enabled() is False
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss  # disabled: no scaling at all
    assert last_record("grad_scaler").action == "disabled"


@needs_amp_scaler
def test_scaler_is_enabled_for_fp16_and_takes_scaler_arguments() -> None:
    scaler = grad_scaler("fp16", device="cpu", init_scale=8.0)
    assert scaler.is_enabled() is True
    assert float(scaler.scale(torch.tensor(2.0))) == 16.0
    record = last_record("grad_scaler")
    assert record.action == "enabled"
    assert record.after == {"device": "cpu", "amp": "float16", "enabled": True}
    assert "underflow" in record.reason


@pytest.mark.skipif(AMP_SCALER is not None, reason="this PyTorch has a CPU GradScaler")
def test_without_a_cpu_scaler_fp16_on_cpu_gets_a_pass_through_that_says_why() -> None:
    scaler = grad_scaler("fp16", device="cpu", init_scale=8.0)
    assert scaler.is_enabled() is False
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss
    record = last_record("grad_scaler")
    assert record.action == "disabled"
    assert record.after == {"device": "cpu", "amp": "float16", "enabled": False}
    if CPU_AUTOCAST_FP16:
        assert record.reason == f"PyTorch {torch.__version__} has no GradScaler for the CPU"
    else:  # PyTorch 2.1: no CPU scaler, and nothing to scale
        assert record.reason == (
            f"no fp16 gradients on cpu: PyTorch {torch.__version__}'s CPU autocast runs bf16 "
            "only: it refuses fp16"
        )


def test_scaler_auto_follows_fast_math_auto_on_cpu() -> None:
    # amp="auto" on a CPU is bf16 (native) or nothing: a scaler is never needed
    assert grad_scaler("auto", device="cpu").is_enabled() is False


def test_scaler_for_cuda_fp16_with_a_faked_gpu(fake_gpu: Callable[..., None]) -> None:
    # A CPU build cannot show a GPU: only torch.cuda.is_available is faked; GradScaler is real.
    fake_gpu((8, 0))
    assert grad_scaler("fp16", device="cuda").is_enabled() is True
    assert grad_scaler("bf16", device="cuda").is_enabled() is False


def test_scaler_for_cuda_without_cuda_is_disabled_quietly() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert grad_scaler("fp16", device="cuda").is_enabled() is False
    assert "fp16 on cuda" in last_record("grad_scaler").reason


@pytest.mark.cuda
def test_scaler_for_cuda_fp16_on_a_real_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert grad_scaler("fp16", device="cuda").is_enabled() is True


def test_scaler_bad_amp_is_refused() -> None:
    with pytest.raises(InvalidValueError, match=r"^grad_scaler\(amp='bf17'\): not an autocast"):
        grad_scaler("bf17")


# --- fast_optimizer ---------------------------------------------------------------------


@needs_fused_cpu
def test_adamw_on_cpu_is_fused_and_recorded() -> None:
    model = torch.nn.Linear(4, 2)
    opt = fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] is True
    assert opt.param_groups[0]["lr"] == 1e-3
    assert len(opt.param_groups[0]["params"]) == 2  # the generator was consumed once
    record = last_record("optimizer")
    assert (record.action, record.after) == (
        "fused",
        {"optimizer": "AdamW", "implementation": "fused"},
    )
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the fused CPU kernel really runs


@pytest.mark.skipif("cpu" in FUSED_DEVICES, reason="this PyTorch fuses optimizers on a CPU")
def test_adamw_on_cpu_without_fused_cpu_kernels_falls_back_to_the_default() -> None:
    model = torch.nn.Linear(4, 2)
    opt = fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert not opt.defaults["fused"] and not opt.defaults["foreach"]
    record = last_record("optimizer")
    assert (record.action, record.after) == (
        "default",
        {"optimizer": "AdamW", "implementation": "default"},
    )
    assert record.reason.startswith(
        f"not fused: fused kernels need floating-point parameters on {', '.join(FUSED_DEVICES)}"
        "; got torch.float32 on cpu; not foreach: "
    )
    model(torch.ones(1, 4)).sum().backward()
    opt.step()


def test_no_fused_kernel_and_no_cpu_foreach_kernel_gives_the_default() -> None:
    model = torch.nn.Linear(4, 2)
    opt = fast_optimizer(torch.optim.RMSprop, model.parameters(), lr=1e-2)
    assert opt.defaults["foreach"] is None  # PyTorch's own default
    record = last_record("optimizer")
    assert record.action == "default"
    assert "no fused implementation" in record.reason and "not cpu" in record.reason


class RefusesFused(torch.optim.SGD):
    def __init__(self, params: Any, fused: Any = None, **kwargs: Any) -> None:
        if fused:
            raise RuntimeError("fused is not supported for this build")
        super().__init__(params, fused=fused, **kwargs)


@needs_fused_sgd
def test_refused_fused_falls_back_cleanly() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = fast_optimizer(RefusesFused, params, lr=0.1)
    assert isinstance(opt, RefusesFused) and not opt.defaults["fused"]
    record = last_record("optimizer")
    assert record.action == "default"
    assert "fused=True refused (RuntimeError: fused is not supported" in record.reason


@needs_fused_sgd
def test_integer_parameters_are_not_fused() -> None:
    params = [torch.zeros(3, dtype=torch.int64)]
    opt = fast_optimizer(torch.optim.SGD, params, lr=0.1)
    assert not opt.defaults["fused"]
    assert "floating-point" in last_record("optimizer").reason


@needs_fused_sgd
def test_an_explicit_choice_is_kept_and_param_groups_work() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [a]}, {"params": [b], "lr": 0.5}]
    opt = fast_optimizer(torch.optim.SGD, groups, lr=0.1, fused=False)
    assert opt.defaults["fused"] is False and opt.param_groups[1]["lr"] == 0.5
    assert last_record("optimizer").action == "as given"
    fused = fast_optimizer(torch.optim.SGD, [{"params": [a]}, {"params": b}], lr=0.1)
    assert fused.defaults["fused"] is True


def test_fast_optimizer_refuses_a_non_optimizer() -> None:
    with pytest.raises(InvalidTypeError, match=r"fast_optimizer\(cls=<class 'dict'>\)"):
        fast_optimizer(dict, [])  # type: ignore[arg-type]


@pytest.mark.parametrize("params", [42, None, torch.ones(3), "weights"])
def test_fast_optimizer_names_params_when_they_are_not_parameters(params: Any) -> None:
    # Failed before: 42 ended in list(42)'s "'int' object is not iterable", naming nothing
    with pytest.raises(InvalidTypeError, match=r"^fast_optimizer\(params=.*model\.parameters"):
        fast_optimizer(torch.optim.AdamW, params)


# --- to_device --------------------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    pair: Pair
    n: int = 0


def test_nested_structures_are_rebuilt_with_their_types() -> None:
    batch = {
        "a": torch.ones(2),
        "list": [torch.zeros(1), "text", None],
        "tuple": (torch.ones(1), 3),
        "pair": Pair(torch.ones(1), "p"),
        "data": Batch(torch.ones(2, dtype=torch.float64), Pair(torch.zeros(1), "q"), n=4),
        "ordered": collections.OrderedDict(z=torch.ones(1)),
        "default": collections.defaultdict(list, k=[torch.ones(1)]),
    }
    moved = to_device(batch, "cpu")
    assert moved is not batch and moved["list"] is not batch["list"]
    assert moved["list"][1:] == ["text", None]
    assert type(moved["tuple"]) is tuple and moved["tuple"][1] == 3
    assert isinstance(moved["pair"], Pair) and moved["pair"].label == "p"
    assert isinstance(moved["data"], Batch) and moved["data"].n == 4
    assert moved["data"].inputs.dtype == torch.float64
    assert isinstance(moved["data"].pair, Pair)
    assert isinstance(moved["ordered"], collections.OrderedDict)
    assert isinstance(moved["default"], collections.defaultdict)
    assert moved["default"].default_factory is list
    assert to_device("not a tensor", "cpu") == "not a tensor"


def test_non_blocking_only_towards_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU build has no GPU to copy to: Tensor.to is replaced by a recorder (and the
    # tensor stays where it is) to see which copies would be non-blocking.
    calls: list[tuple] = []

    def record(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        calls.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", record)
    to_device({"x": torch.ones(1), "y": [torch.ones(1)]}, "cuda")
    to_device(torch.ones(1), "cpu")
    assert calls == [("cuda", True), ("cuda", True), ("cpu", False)]


def test_to_device_refuses_a_batch_that_contains_itself() -> None:
    # Failed before: RecursionError, after thousands of frames
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    through: dict[str, Any] = {"x": [torch.ones(1)]}
    through["x"].append(through)
    for batch in (loop, through):
        with pytest.raises(
            InvalidValueError, match=r"^to_device\(batch=\.\.\.\): the batch contains itself"
        ):
            to_device(batch, "cpu")
    shared = [torch.ones(1)]
    moved = to_device({"a": shared, "b": shared}, "cpu")  # shared, not circular: fine
    assert torch.equal(moved["a"][0], moved["b"][0])
    deep: list[Any] = []
    for _ in range(5 * sys.getrecursionlimit()):
        deep = [deep]
    with pytest.raises(InvalidValueError, match="recursion limit"):
        to_device(deep, "cpu")


def test_to_device_refuses_a_bad_device() -> None:
    with pytest.raises(InvalidValueError, match=r"^to_device\(device='gpu'\)"):
        to_device(torch.ones(1), "gpu")


# --- a full small training loop (behaviour 4) ---------------------------------------------


def test_training_loop_under_speedup_with_scaler_and_fast_optimizer() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    true_w = torch.randn(16, 1, generator=gen)
    data = [torch.randn(64, 16, generator=gen) for _ in range(8)]
    batches = [{"x": x, "y": x @ true_w} for x in data]
    opt = fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    scaler = grad_scaler("bf16", device="cpu")
    before = speedflags.snapshot()

    @speedflags.speedup(amp="bf16", device="cpu")
    def train_step(batch: dict) -> torch.Tensor:
        batch = to_device(batch, "cpu")
        out = model(batch["x"])
        assert out.dtype == torch.bfloat16  # autocast is on inside the step
        loss = torch.nn.functional.mse_loss(out.float(), batch["y"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [float(train_step(batches[step % len(batches)])) for step in range(24)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
    assert speedflags.snapshot() == before
    assert train_step.stats.calls == 24
