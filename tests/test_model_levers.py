"""The model levers: ``fast_math(model=net, param_dtype=..., memory_format=...)``.

What they promise, each shown on real modules and real torch: the model computes with casts
of its parameters (and in channels_last) inside the block, its parameters, buffers,
``state_dict`` and optimizer references are its own throughout, and afterwards every module
has its own class and every tensor its own dtype, layout and bits.

Most tests run under ``cpu_with_bf16`` (the CPU's bf16 answer faked to "native", so that no
emulation warning fires on a CPU without bf16 instructions; the bf16 arithmetic itself is
real, emulated or not). ``tests/test_model_levers_compile.py`` has the torch.compile cases.
"""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _small_models import convnet, mlp
from conftest import last_seq, records_since
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import speedflags
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers import _model_casts, _model_shadow

pytestmark = pytest.mark.usefixtures("cpu_with_bf16")

BF16 = torch.bfloat16


class Ops(TorchDispatchMode):
    """Records each aten call: its name and its tensor arguments' (dtype, strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[torch.dtype, tuple[int, ...]]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.calls.append(
            (func.__name__.split(".")[0], [(t.dtype, tuple(t.stride())) for t in tensors])
        )
        return func(*args, **(kwargs or {}))

    def of(self, name: str) -> list[list[tuple[torch.dtype, tuple[int, ...]]]]:
        return [tensors for called, tensors in self.calls if called == name]


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a model lever must leave as it found: objects, classes, dtypes, strides, bits."""
    return {
        "classes": [(name, type(m)) for name, m in model.named_modules()],
        "objects": {name: id(t) for name, t in tensors_of(model).items()},
        "layout": {n: (t.dtype, t.shape, t.stride()) for n, t in tensors_of(model).items()},
        "values": {n: t.detach().clone() for n, t in tensors_of(model).items()},
        "keys": list(model.state_dict()),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["classes"] == before["classes"]
    assert after["objects"] == before["objects"]
    assert after["layout"] == before["layout"]
    assert after["keys"] == before["keys"]
    for name, value in before["values"].items():
        assert torch.equal(after["values"][name], value), name


# --- param_dtype ------------------------------------------------------------------------------


def test_a_linear_inside_computes_in_bf16_and_the_output_comes_back_in_the_inputs_dtype() -> None:
    net, x = mlp(), torch.randn(3, 8)
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        out = net(x)
    assert out.dtype == torch.float32
    matmuls = ops.of("addmm")
    assert len(matmuls) == 2 and all(t[0] == BF16 for call in matmuls for t in call)
    # the norm takes the bf16 activations with its float32 parameters, as autocast feeds it
    (layer_norm,) = ops.of("native_layer_norm")
    assert [t[0] for t in layer_norm] == [BF16, torch.float32, torch.float32]
    # the same arithmetic as a bf16 copy of the model, norm parameters in float32, by hand
    h = torch.nn.functional.linear(x.to(BF16), net[0].weight.to(BF16), net[0].bias.to(BF16))
    h = net[1](h)
    h = torch.nn.functional.gelu(h)
    expected = torch.nn.functional.linear(h, net[3].weight.to(BF16), net[3].bias.to(BF16))
    assert torch.equal(out, expected.float())


def test_an_input_in_bf16_gets_its_output_in_bf16_and_integer_inputs_stay_integers() -> None:
    torch.manual_seed(0)
    embed = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2))
    with speedflags.fast_math(model=embed, param_dtype="bf16"):
        assert embed(torch.tensor([[1, 2]])).dtype == torch.float32  # no floating input: own
        assert mlp()(torch.randn(1, 8)).dtype == torch.float32  # another model: untouched
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        assert net(torch.randn(2, 8, dtype=BF16)).dtype == BF16


def test_the_models_own_tensors_state_dict_and_optimizer_references_inside_and_after() -> None:
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    before = snapshot(net)
    params = list(net.parameters())
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        net(torch.randn(2, 8)).sum().backward()
        assert [id(p) for p in net.parameters()] == [id(p) for p in params]
        assert optimizer.param_groups[0]["params"] == params
        state = net.state_dict()
        assert list(state) == before["keys"]
        assert all(t.dtype == torch.float32 for t in state.values())
        assert all(state[n].data_ptr() == p.data_ptr() for n, p in net.named_parameters())
        assert net[0].weight is params[0]  # outside forward, the attribute is the parameter
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    net.zero_grad(set_to_none=True)
    assert_unchanged(net, before)


def test_after_the_block_every_module_has_its_own_class_and_computes_as_before() -> None:
    net, x = mlp(), torch.randn(4, 8)
    expected = net(x)
    before = snapshot(net)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        own = before_types(before)
        inside = [type(m) for m in net.modules()]
        assert all(isinstance(m, cls) for m, cls in zip(net.modules(), own, strict=True))
        assert inside != own  # shadowed inside, under the same names
        assert [cls.__name__ for cls in inside] == [cls.__name__ for cls in own]
    assert_unchanged(net, before)
    assert torch.equal(net(x), expected)


def before_types(before: dict[str, Any]) -> list[type]:
    return [cls for _, cls in before["classes"]]


def test_small_updates_are_kept_on_the_float32_parameters() -> None:
    # An update far below bf16's resolution (2^-8 of the weight): lost by a bf16 model, kept
    # by param_dtype, whose optimizer steps the float32 parameters.
    def train(model: nn.Module, block: Any) -> torch.Tensor:
        start = model.weight.detach().float().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        for _ in range(5):
            with block:
                x = torch.ones(4, 4, dtype=next(model.parameters()).dtype)
                model(x).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return (model.weight.detach().float() - start).abs()

    torch.manual_seed(0)
    ours = nn.Linear(4, 4)
    plain = copy.deepcopy(ours).to(BF16)
    kept = train(ours, speedflags.fast_math(model=ours, param_dtype="bf16"))
    lost = train(plain, speedflags.fast_math(cudnn_benchmark=False))
    assert int((kept > 0).sum()) == 16
    assert int((lost > 0).sum()) < 16


def test_norm_layers_keep_float32_and_batchnorm_statistics_update_in_float32() -> None:
    net = convnet()
    bn = net[1]
    mean_before = bn.running_mean.clone()
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        net(torch.randn(4, 3, 6, 6))
    assert bn.running_mean.dtype == torch.float32 and bn.weight.dtype == torch.float32
    assert not torch.equal(bn.running_mean, mean_before)  # updated, in float32
    batch_norms = [c for name, c in ops.calls if "batch_norm" in name]
    # the bf16 activations as they come, with float32 weight, bias and running statistics
    assert batch_norms and [t[0] for t in batch_norms[0]] == [BF16] + [torch.float32] * 4
    assert all(t[0] == BF16 for t in ops.of("convolution")[0][:2])  # input and weight


def _param_casts(ops: Ops, net: nn.Module) -> int:
    shapes = {tuple(p.stride()) for p in net.parameters()}
    return sum(
        1 for tensors in ops.of("_to_copy") if tensors and tensors[0][0] == torch.float32
        and tensors[0][1] in shapes
    )  # fmt: skip


def test_a_cast_is_made_once_per_block_in_inference_and_once_per_optimizer_step() -> None:
    net = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8, dtype=BF16)  # a bf16 input: no boundary cast to count
    with torch.no_grad(), speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        for _ in range(3):
            net(x)
    assert _param_casts(ops, net) == 1
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with speedflags.fast_math(model=net, param_dtype="bf16"), Ops() as ops:
        for _ in range(2):
            net(x).float().sum().backward()  # two micro-batches: one cast
        optimizer.step()  # the weight changed: cast again
        net(x).float().sum().backward()
    if _model_casts.steps_are_seen():
        assert _param_casts(ops, net) == 2
    else:  # PyTorch 2.1 once torch.compile ran here: renewed after each backward instead
        assert torch.__version__ < "2.2"
        assert _param_casts(ops, net) == 3


def test_a_write_to_a_parameter_inside_the_block_reaches_the_parameter() -> None:
    net = nn.Linear(4, 4)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        nn.init.constant_(net.weight, 0.5)
        assert net(torch.ones(1, 4)).sum().item() == pytest.approx(
            (2.0 + net.bias.to(BF16).float()).sum().item(), rel=1e-2
        )
    assert torch.all(net.weight == 0.5)


def test_param_dtype_false_inside_an_outer_block_computes_in_the_parameters_dtype() -> None:
    net, x = mlp(), torch.randn(2, 8)
    expected = net(x)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        with speedflags.fast_math(model=net, param_dtype=False), Ops() as ops:
            assert torch.equal(net(x), expected)
        assert all(t[0] == torch.float32 for call in ops.of("addmm") for t in call)
        with Ops() as ops:
            net(x)
        assert all(t[0] == BF16 for call in ops.of("addmm") for t in call)


def test_an_exception_in_the_body_restores_the_model() -> None:
    net = convnet()
    before = snapshot(net)
    with pytest.raises(ZeroDivisionError):
        with speedflags.fast_math(model=net, param_dtype="bf16", memory_format="channels_last"):
            net(torch.randn(2, 3, 6, 6))
            1 / 0  # noqa: B018
    before["values"] = {k: v for k, v in before["values"].items() if "running" not in k}
    before["values"].pop("1.num_batches_tracked")
    assert_unchanged(net, before)


def test_the_history_records_each_model_lever_with_its_model() -> None:
    net = convnet()
    seq = last_seq()
    with speedflags.fast_math(model=net, param_dtype="bf16", memory_format="channels_last"):
        pass
    records = records_since(seq)
    assert [(r.lever, r.action) for r in records] == [
        ("param_dtype", "set"),
        ("memory_format", "set"),
        ("memory_format", "restore"),
        ("param_dtype", "restore"),
    ]
    tag = records[0].after["model"]
    assert tag.startswith("Sequential#")
    assert records[0].before == {"model": tag, "param_dtype": False}
    assert records[0].after == {"model": tag, "param_dtype": "bfloat16"}
    assert records[1].after == {"model": tag, "memory_format": "channels_last"}
    assert records[3].after == {"model": tag, "param_dtype": False}
    assert "model=Sequential" in records[0].label


def test_speedup_steps_train_with_param_dtype() -> None:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    @speedflags.speedup(model=net, param_dtype="bf16", device="cpu")
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = [step(torch.randn(8, 8)).item() for _ in range(3)]
    assert all(loss == loss for loss in losses) and step.stats.calls == 3
    assert all(type(m).__dict__.get("_speedflags_own_class") is None for m in net.modules())


def test_schedule_entries_take_the_model() -> None:
    net = mlp()
    with speedflags.Schedule({0: {"param_dtype": "bf16"}, 2: {}}, model=net) as schedule:
        schedule.step(0)
        assert _model_shadow.shadowed(net)
        schedule.step(2)
        assert not _model_shadow.shadowed(net)
    with pytest.raises(InvalidValueError, match="model= is for the model levers"):
        speedflags.Schedule({0: {"tf32": True}}, model=net)


def test_a_model_saved_or_copied_inside_the_block_is_an_ordinary_model() -> None:
    net = mlp()
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        buffer = io.BytesIO()
        torch.save(net, buffer)
        copied = copy.deepcopy(net)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, copied):
        assert [type(m) for m in other.modules()] == [type(m) for m in net.modules()]
        assert all(p.dtype == torch.float32 for p in other.parameters())


def test_another_thread_calling_the_model_computes_in_bf16_too() -> None:
    net, x = mlp(), torch.randn(2, 8)
    seen: list[torch.dtype] = []

    def call() -> None:
        with Ops() as ops:
            net(x)
        seen.extend(t[0] for call in ops.of("addmm") for t in call)

    with speedflags.fast_math(model=net, param_dtype="bf16"):
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
    assert seen and set(seen) == {BF16}


def test_blocks_on_two_models_in_two_threads_exit_in_any_order() -> None:
    first, second = mlp(), mlp()
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with speedflags.fast_math(model=second, param_dtype="bf16"):
            entered.set()
            release.wait(30)

    worker = threading.Thread(target=hold)
    worker.start()
    entered.wait(30)
    with speedflags.fast_math(model=first, param_dtype="bf16"):
        assert _model_shadow.shadowed(first) and _model_shadow.shadowed(second)
        release.set()
        worker.join()
        assert _model_shadow.shadowed(first) and not _model_shadow.shadowed(second)
    assert not _model_shadow.shadowed(first)


# --- memory_format ----------------------------------------------------------------------------


def test_conv_weights_are_channels_last_inside_and_come_back_with_their_strides() -> None:
    net = convnet()
    weight = net[0].weight
    strides = weight.stride()
    values = weight.detach().clone()
    with speedflags.fast_math(model=net, memory_format="channels_last"):
        assert net[0].weight is weight
        assert weight.is_contiguous(memory_format=torch.channels_last)
        assert not weight.is_contiguous()
    assert net[0].weight is weight and weight.stride() == strides
    assert torch.equal(weight, values)


def test_a_convs_input_arrives_in_channels_last() -> None:
    net = convnet()
    x = torch.randn(2, 3, 6, 6)
    expected = net(x)
    with speedflags.fast_math(model=net, memory_format="channels_last"), Ops() as ops:
        out = net(x)
    conv_input, conv_weight = ops.of("convolution")[0][:2]
    cl = torch.empty(2, 3, 6, 6).contiguous(memory_format=torch.channels_last).stride()
    assert conv_input[1] == cl
    assert conv_weight[1] == weight_cl_stride(net[0].weight)
    torch.testing.assert_close(out, expected)


def weight_cl_stride(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(torch.empty(weight.shape).contiguous(memory_format=torch.channels_last).stride())


def test_updates_made_inside_are_kept_in_the_original_layout() -> None:
    net = convnet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    weight = net[0].weight
    start = weight.detach().clone()
    with speedflags.fast_math(model=net, memory_format="channels_last"):
        net(torch.randn(2, 3, 6, 6)).sum().backward()
        optimizer.step()
        inside = weight.detach().clone()
    assert weight.is_contiguous()
    assert torch.equal(weight, inside) and not torch.equal(weight, start)


def test_both_levers_together_and_nested_separately() -> None:
    net = convnet()
    before = snapshot(net)
    x = torch.randn(2, 3, 6, 6)
    with speedflags.fast_math(model=net, param_dtype="bf16"):
        with speedflags.fast_math(model=net, memory_format="channels_last"), Ops() as ops:
            net.eval()
            assert net(x).dtype == torch.float32
        conv_input, conv_weight = ops.of("convolution")[0][:2]
        assert conv_input[0] == BF16 and conv_weight[0] == BF16
        assert net[0].weight.is_contiguous()  # the inner block gave the layout back
        assert net[0].weight.dtype == torch.float32
    net.train()
    assert_unchanged(net, before)


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"param_dtype": "bf16"}, InvalidValueError, "give it as model="),
        ({"memory_format": "channels_last"}, InvalidValueError, "give it as model="),
        ({"model": "net", "param_dtype": "bf16"}, InvalidTypeError, "expected a torch.nn.Module"),
        ({"model": nn.Linear(2, 2), "tf32": True}, InvalidValueError, "model= is for"),
        ({"model": nn.Linear(2, 2), "param_dtype": "bf17"}, InvalidValueError, "'bf17'"),
        ({"model": nn.Linear(2, 2), "param_dtype": torch.float32}, InvalidValueError, "bf16"),
        ({"model": nn.Linear(2, 2), "param_dtype": 16}, InvalidTypeError, "got int"),
        ({"model": nn.Linear(2, 2), "memory_format": "nhwc"}, InvalidValueError, "'nhwc'"),
        ({"model": nn.Linear(2, 2), "memory_format": True}, InvalidTypeError, "got bool"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(
    kwargs: dict[str, Any], error: type, words: str
) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(")):
        speedflags.fast_math(**kwargs)
    with pytest.raises(error):
        speedflags.speedup(**kwargs)


@pytest.fixture
def process_group() -> Iterator[None]:
    import os

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this PyTorch has no torch.distributed")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_model_sharded_by_fsdp2_is_refused(process_group: None) -> None:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip(f"PyTorch {torch.__version__} has no torch.distributed.fsdp.fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    net = mlp()
    mesh = init_device_mesh("cpu", (1,))
    policy = fsdp.MixedPrecisionPolicy(param_dtype=BF16)
    fsdp.fully_shard(net[0], mesh=mesh, mp_policy=policy)
    with pytest.raises(InvalidValueError, match="sharded by FSDP"):
        speedflags.fast_math(model=net, param_dtype="bf16")
    with pytest.raises(InvalidValueError, match="sharded by FSDP"):
        speedflags.fast_math(model=net, memory_format="channels_last")


def test_a_class_that_cannot_be_swapped_in_undoes_every_swap_before_raising(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python refuses a __class__ whose layout differs: made here by injecting a shadow class
    # with a slot of its own for the second Linear, after the first was swapped.
    make = _model_shadow._make_class
    seen: list[type] = []

    def made(cls: type, *args: Any) -> type:
        shadow = make(cls, *args)
        seen.append(cls)
        if len(seen) == 3:  # the root, the Linear, then the convolution
            return type(cls.__name__, (shadow,), {"__slots__": ("extra",)})
        return shadow

    monkeypatch.setattr(_model_shadow, "_make_class", made)
    net = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    before = snapshot(net)
    with pytest.raises(TypeError, match="__class__"):
        with speedflags.fast_math(model=net, param_dtype="bf16"):
            pass  # pragma: no cover - never entered
    assert_unchanged(net, before)
