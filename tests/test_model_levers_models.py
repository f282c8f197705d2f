"""The model levers on the models users have: overlapping models, lazy modules, TorchScript,
weights computed by hooks or parametrizations, models cast between blocks, modules added
inside a block, tracing and export, and what ``param_dtype`` decides for float64 parameters,
dataclass outputs and float32 buffers.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from _small_models import mlp
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils._python_dispatch import TorchDispatchMode

import speedflags
from speedflags.errors import DeviceUnavailableWarning, InvalidValueError
from speedflags.levers import _model_shadow

pytestmark = pytest.mark.usefixtures("cpu_with_bf16")

BF16 = torch.bfloat16


class Ops(TorchDispatchMode):
    """Records each aten call's name and its tensor arguments' dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.__name__.split(".")[0], dtypes))
        return func(*args, **(kwargs or {}))

    def of(self, name: str) -> list[list[torch.dtype]]:
        return [dtypes for called, dtypes in self.calls if called == name]


def none_shadowed(model: nn.Module) -> bool:
    return not any(_model_shadow.shadowed(m) for m in model.modules())


# --- overlapping models ---------------------------------------------------------------------


def test_blocks_on_a_model_and_its_submodule_are_refused_before_anything_changes() -> None:
    # Failed before: the submodule computed in float32 inside its own bf16 block, or the
    # forward failed, depending on which block was entered first.
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        classes = [type(m) for m in net.modules()]
        with pytest.raises(InvalidValueError, match=r"is also part of Sequential#\d+") as info:
            with speedflags.fast_math(model=net[0], param_dtype="bf16"):
                pass  # pragma: no cover - refused
        assert "Nothing was changed" in str(info.value)
        assert [type(m) for m in net.modules()] == classes
        assert net(torch.randn(2, 8)).dtype == torch.float32
    assert none_shadowed(net)
    inner = net[0]  # the other order: the submodule first
    with speedflags.fast_math(model=inner, memory_format="channels_last"):
        with pytest.raises(InvalidValueError, match="its submodule '0' \\(Linear\\) is also part"):
            with speedflags.fast_math(model=net, param_dtype="bf16"):
                pass  # pragma: no cover - refused
    assert none_shadowed(net)


def test_two_models_sharing_an_encoder_cannot_both_be_under_a_lever() -> None:
    encoder = nn.Linear(4, 4)
    first, second = nn.Sequential(encoder, nn.Linear(4, 2)), nn.Sequential(encoder, nn.Linear(4, 3))
    with speedflags.fast_math(model=first, param_dtype="bf16"):
        with pytest.raises(InvalidValueError, match="share modules"):
            with speedflags.fast_math(model=second, param_dtype="bf16"):
                pass  # pragma: no cover - refused
    with speedflags.fast_math(model=second, param_dtype="bf16"):  # one at a time: fine
        assert second(torch.randn(1, 4)).dtype == torch.float32


def test_nested_blocks_on_the_same_model_and_a_module_taken_out_are_fine() -> None:
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        with speedflags.fast_math(model=net, param_dtype="bf16"):
            assert net(torch.randn(1, 8)).dtype == torch.float32
        head = net[3]
        del net[3]  # taken out of the model: no longer part of it, it gets its class back
        with speedflags.fast_math(model=head, param_dtype="bf16"):
            assert head(torch.randn(1, 16)).dtype == torch.float32
    assert none_shadowed(net) and none_shadowed(head)


# --- modules that build or compute their weights ----------------------------------------------


def test_an_uninitialised_lazy_module_runs_inside_the_block_and_becomes_what_it_would() -> None:
    # Failed before: the lazy Linear raised inside a param_dtype block.
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(x)
        again = net(x)
    assert out.dtype == torch.float32 and torch.equal(out, again)
    assert all(dtypes == [BF16, BF16, BF16] for dtypes in ops.of("addmm"))
    assert type(net[0]) is nn.Linear and net[0].weight.dtype == torch.float32
    assert net[0].weight.abs().sum() > 0  # initialised as outside the block (not left empty)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    plain(x)
    assert torch.equal(plain[0].weight, net[0].weight)  # the same initial weights
    with speedflags.fast_math(model=net, param_dtype="bf16"):  # and it takes part next time
        assert net(x).dtype == torch.float32
    assert none_shadowed(net)


@pytest.mark.parametrize(
    "wrap",
    [
        nn.utils.spectral_norm,
        nn.utils.weight_norm,
        parametrizations.spectral_norm,
        parametrizations.weight_norm,
    ],
    ids=[
        "spectral_norm",
        "weight_norm",
        "parametrizations.spectral_norm",
        "parametrizations.weight_norm",
    ],
)
def test_a_weight_computed_before_each_call_runs_in_bf16_from_float32(wrap: Any) -> None:
    # Failed before for the hook form of spectral_norm: its float32 buffers met the bf16
    # weight. The weight is now computed in float32 from the float32 parameters, and cast
    # where the layer reads it; gradients reach the parameters it comes from.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's hook form: deprecated
        torch.manual_seed(0)
        net = nn.Sequential(wrap(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(x)
        out.sum().backward()
    assert out.dtype == torch.float32
    assert ops.of("addmm") and all(dtypes[:3] == [BF16] * 3 for dtypes in ops.of("addmm")[:2])
    grads = [p.grad for p in net[0].parameters()]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    assert none_shadowed(net)


def test_a_torchscript_model_or_submodule_is_refused_clearly_before_anything_changes() -> None:
    # Failed before: an internal AttributeError from inside the block.
    scripted = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(InvalidValueError, match="the model is a TorchScript module"):
        speedflags.fast_math(model=scripted, param_dtype="bf16")
    holder = nn.Sequential(nn.Linear(2, 2), torch.jit.trace(nn.Linear(2, 2), torch.ones(1, 2)))
    with pytest.raises(InvalidValueError, match="its submodule '1' is a TorchScript module"):
        speedflags.fast_math(model=holder, memory_format="channels_last")
    spec = speedflags.fast_math(model=nn.Sequential(nn.Linear(2, 2)), param_dtype="bf16")
    spec.model.append(torch.jit.script(nn.Linear(2, 2)))  # scripted after the spec was made
    with pytest.raises(InvalidValueError, match="TorchScript"):
        with spec:
            pass  # pragma: no cover - refused
    assert none_shadowed(spec.model)


# --- the model changes inside or between blocks ---------------------------------------------


def test_a_model_cast_between_or_inside_blocks_computes_with_its_new_dtype() -> None:
    # Failed before: the dtype seen at the model's first block was kept for its lifetime,
    # and the norm layers failed with "mixed dtype (CPU)" after .to(float64) or .to(bf16).
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net(torch.randn(2, 8))
    net.to(torch.float64)
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(torch.randn(2, 8, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert all(dtypes[:3] == [BF16] * 3 for dtypes in ops.of("addmm"))
    (norm,) = ops.of("native_layer_norm")
    assert norm == [torch.float64] * 3  # float64 parameters: float64 on an upcast input
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net.to(torch.bfloat16)
        assert net(torch.randn(2, 8)).dtype == torch.float32  # back in the input's dtype
        assert net(torch.randn(2, 8, dtype=BF16)).dtype == BF16
    assert all(p.dtype == BF16 for p in net.parameters())
    assert none_shadowed(net)


def test_a_module_or_parameter_added_inside_the_block_takes_part() -> None:
    # Failed before: the new head kept float32 parameters and met bf16 activations.
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net(torch.randn(2, 8))
        net.append(nn.Linear(4, 3))
        net[0].register_parameter("scale", nn.Parameter(torch.ones(16)))
        with Ops() as ops:
            out = net(torch.randn(2, 8))
        assert out.shape == (2, 3) and out.dtype == torch.float32
        assert len(ops.of("addmm")) == 3 and all(d[:3] == [BF16] * 3 for d in ops.of("addmm"))
        assert net[0].scale.dtype == torch.float32  # outside forward: the parameter
        assert _model_shadow.shadowed(net[4])
    assert none_shadowed(net)


def test_a_module_built_elsewhere_inside_the_block_is_left_alone() -> None:
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        other = nn.Sequential(nn.Linear(2, 2))  # registrations anywhere call the hooks
        net(torch.randn(1, 8))
        assert none_shadowed(other)
        with Ops() as ops:
            other(torch.randn(1, 2))
        assert ops.of("addmm") == [[torch.float32] * 3]


# --- tracing and export -------------------------------------------------------------------------


def test_torch_jit_trace_inside_the_block_traces_the_bf16_computation() -> None:
    # Failed before: trace's sanity check (the graph held a cast made before tracing).
    net, x = mlp(), torch.randn(2, 8)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        expected = net(x)
        traced = torch.jit.trace(net, x)
    assert torch.equal(traced(x), expected)  # it keeps computing as the block did
    assert none_shadowed(net)


def _inlines_modules() -> bool:
    config = torch._dynamo.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(config, "inline_inbuilt_nn_modules", False))


def test_torch_export_inside_the_block_exports_the_bf16_computation_or_says_why_not() -> None:
    # Failed before: export reached a data pointer of a FakeTensor inside the cast cache.
    net, x = mlp(), torch.randn(2, 8)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        expected = net(x)
        if not _inlines_modules():  # PyTorch 2.1-2.4 by default: the model runs eagerly
            with pytest.raises(speedflags.LeverInGraphError, match=r"Export .* outside"):
                torch.export.export(net, (x,))
            return
        exported = torch.export.export(net, (x,))
    torch.testing.assert_close(exported.module()(x), expected)
    assert none_shadowed(net)


# --- decided: what param_dtype does with float64, dataclasses, float32 buffers, devices ----------


def test_float64_parameters_are_cast_too_unlike_autocast() -> None:
    # param_dtype says what the model computes in: every floating parameter is cast, float64
    # included (autocast leaves float64 ops alone). The output comes back in float64.
    net = nn.Linear(4, 4).double()
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(torch.randn(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert ops.of("addmm") == [[BF16] * 3]
    with torch.autocast("cpu", BF16), Ops() as ops:
        net(torch.randn(2, 4, dtype=torch.float64))
    assert ops.of("addmm") == [[torch.float64] * 3]


@dataclasses.dataclass(frozen=True)
class Prediction:
    logits: torch.Tensor
    hidden: list[torch.Tensor]
    note: str = "kept"


class WithDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Prediction:
        h = self.layer(x)
        return Prediction(h, [h, h])


def test_dataclass_outputs_come_back_in_the_inputs_dtype() -> None:
    # Failed before: a dataclass (not a Mapping) came back in bf16.
    net = WithDataclass()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        out = net(torch.randn(2, 4))
    assert type(out) is Prediction and out.note == "kept"
    assert out.logits.dtype == torch.float32 and all(h.dtype == torch.float32 for h in out.hidden)


class Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.register_buffer("projection", torch.randn(4, 4))
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor, cast: bool = False) -> torch.Tensor:
        h = self.layer(x) + self.offset  # a float32 buffer promotes: float32 from here on
        projection = self.projection.to(h.dtype) if cast else self.projection
        return h @ projection


def test_float32_buffers_stay_float32_and_meet_the_activations_as_pytorch_says() -> None:
    # Buffers are state (running statistics, masks, position tables: a bf16 RoPE table loses
    # the positions), so param_dtype never casts them. A float32 buffer added to bf16
    # activations promotes them, as in any PyTorch model; one that meets them in a matmul
    # raises PyTorch's own dtype error unless the model casts it (projection.to(h.dtype)).
    net = Projected()
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(torch.randn(2, 4), cast=True)
    assert out.dtype == torch.float32
    assert net.projection.dtype == torch.float32 and net.offset.dtype == torch.float32
    assert ops.of("addmm")[0][:3] == [BF16] * 3

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.mm(self.layer(x), self.table)  # bf16 @ float32

    scaled = Scaled()
    with speedflags.fast_math(model=scaled, param_dtype="bf16"):
        with pytest.raises(RuntimeError, match="dtype"):
            scaled(torch.randn(2, 4))


def test_snapshot_is_process_state_and_the_ledger_shows_the_model_levers() -> None:
    # snapshot() holds what every rank and every benchmark compares: process and thread
    # state. A model lever's state is one model's: the open frames and the history say it.
    net = mlp()
    before = speedflags.snapshot()
    with speedflags.fast_math(model=net, param_dtype="bf16") as frame:
        assert speedflags.snapshot() == before
        assert frame in speedflags.ledger().open_frames()
        assert frame.values == {"param_dtype": "bfloat16"} and "model=Sequential" in frame.label
    assert speedflags.ledger().history[-1].after["param_dtype"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="device='cuda' has CUDA here")
def test_device_cuda_without_cuda_says_the_lever_acts_on_the_cpu_model() -> None:
    # Failed before: the warning and the history said param_dtype changed nothing, while
    # the CPU model computed in bf16.
    net = mlp()
    with pytest.warns(DeviceUnavailableWarning, match="acts on the model where its parameters"):
        with speedflags.fast_math(model=net, param_dtype="bf16", device="cuda"), Ops() as ops:
            net(torch.randn(1, 8))
    assert all(dtypes[:3] == [BF16] * 3 for dtypes in ops.of("addmm"))
    record = [r for r in speedflags.ledger().history if r.lever == "param_dtype"][-2]
    assert record.action == "set" and "acts on the model's device, cpu" in record.reason
    assert "changes nothing" not in record.reason
