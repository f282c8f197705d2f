"""The ``fp8`` model lever: ``fast_math(model=net, fp8=True)`` through torchao's float8 training.

On a CPU the lever runs torchao's emulation (float8 casts, a float32 matmul): the same
``Float8Linear`` code a GPU runs, with the scaled matmul replaced by its emulation, so these
tests show on real torch and real torchao what the block changes and that it changes nothing
afterwards. The tests that need torchao skip, saying so, where it is not installed (the floor
leg, the Python 3.12 leg without extras); the refusals (torchao missing, an older PyTorch)
run everywhere. A GPU's compute capability is faked where a test is about sm89 (a CPU build
cannot show one); ``tests/test_gpu_fp8.py`` runs the lever on a real GPU.

Layers take part from 2048 features (the size rule), so the models here have layers of
2048: emulated, a forward at batch 4 costs milliseconds.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from conftest import last_seq, records_since
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import speedflags
from speedflags._version import install_hint
from speedflags.errors import (
    InvalidTypeError,
    InvalidValueError,
    LeverUnavailableError,
    SlowPathWarning,
)
from speedflags.levers import _torchao, fp8
from speedflags.levers.fp8 import fp8_effect, validate_fp8

D = 2048  # the smallest layer the size rule converts
E4M3 = torch.float8_e4m3fn
needs_torchao = pytest.mark.skipif(
    _torchao.missing() is not None, reason=f"needs torchao: {_torchao.missing()}"
)
# on a CPU every fp8 block runs emulated and says so once per process (asserted below)
quiet_emulation = pytest.mark.filterwarnings(
    "ignore:fp8=.* on cpu is slower than without it:speedflags.errors.SlowPathWarning"
)


def mlp(small: bool = True) -> nn.Sequential:
    """Two layers the size rule converts, a LayerNorm, and a small head it leaves out."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(D, D), nn.GELU(), nn.Linear(D, D), nn.LayerNorm(D)]
    if small:
        layers.append(nn.Linear(D, 16))
    return nn.Sequential(*layers)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything the lever must leave as it found: objects, classes, dtypes, strides, bits."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        "modules": [(name, id(m), type(m)) for name, m in model.named_modules()],
        "objects": {name: id(t) for name, t in tensors.items()},
        "layout": {n: (t.dtype, t.shape, t.stride()) for n, t in tensors.items()},
        "values": {n: t.detach().clone() for n, t in tensors.items()},
        "keys": list(model.state_dict()),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any], values: bool = True) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["objects"] == before["objects"]
    assert after["layout"] == before["layout"]
    assert after["keys"] == before["keys"]
    if values:
        for name, value in before["values"].items():
            assert torch.equal(after["values"][name], value), name


def kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model]


class Casts(TorchDispatchMode):
    """Records the dtypes each aten call produced."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.made.append(out.dtype)
        return out


@pytest.fixture
def no_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao not installed: simulated by making its import fail (``sys.modules`` entry
    None: ``import torchao`` raises ImportError, ``find_spec`` finds nothing), with the
    adapter's record of an earlier import forgotten for the test."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setattr(_torchao, "_loaded", None)
    monkeypatch.setattr(_torchao, "_failed", None)


# --- refused before anything changes -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("fp9", InvalidValueError, "not a float8 recipe torchao names"),
        ("e4m3", InvalidValueError, "valid: True, False or a torchao recipe name"),
        (3, InvalidTypeError, "got int"),
        (torch.float8_e4m3fn, InvalidTypeError, "a dtype is not a recipe"),
        (None.__class__, InvalidTypeError, "got type"),
    ],
)
def test_a_bad_value_is_refused_when_the_block_is_made(value: Any, error: type, words: str) -> None:
    net = mlp()
    before = snapshot(net)
    with pytest.raises(error, match=words) as info:
        speedflags.fast_math(model=net, fp8=value)
    assert f"fast_math(fp8={value!r})" in str(info.value)
    assert "'tensorwise', 'rowwise'" in str(info.value)  # the valid choices
    with pytest.raises(error):
        speedflags.speedup(model=net, fp8=value)
    with pytest.raises(error):
        speedflags.Schedule({0: {"fp8": value}}, model=net)
    assert_unchanged(net, before)


def test_fp8_without_a_model_is_refused() -> None:
    with pytest.raises(InvalidValueError, match=r"fast_math\(fp8=...\): fp8 acts on one model"):
        speedflags.fast_math(fp8=True)
    with pytest.raises(InvalidValueError, match="give it as model="):
        speedflags.speedup(fp8="rowwise")


def test_values_normalise_to_recipe_names() -> None:
    assert validate_fp8(True) == "tensorwise"  # torchao's default recipe
    assert validate_fp8("RowWise") == "rowwise"
    assert validate_fp8("rowwise_with_gw_hp") == "rowwise_with_gw_hp"
    assert validate_fp8(False) is None
    assert speedflags.fast_math(model=mlp(), fp8=True).levers == {"fp8": "tensorwise"}


def test_torchao_missing_refuses_the_block_before_anything_changes(no_torchao: None) -> None:
    net = mlp()
    before = snapshot(net)
    seq = last_seq()
    spec = speedflags.fast_math(model=net, fp8=True, tf32=True, device="cpu")
    with pytest.raises(LeverUnavailableError) as info:
        with spec:
            pytest.fail("the block ran")  # pragma: no cover
    message = str(info.value)
    if _torchao._release(torch.__version__) < _torchao.NEEDS_TORCH:  # the floor leg says so first
        assert "needs PyTorch 2.11 or newer" in message
    else:
        assert f"torchao is not installed ({install_hint('fp8')})" in message
    assert "fp8='tensorwise'" in message and "Nothing was changed" in message
    assert_unchanged(net, before)
    assert records_since(seq) == []  # not even tf32 was set
    assert torch.backends.cuda.matmul.allow_tf32 is False
    with speedflags.fast_math(model=net, fp8=False):  # off needs no torchao
        assert kinds(net)[0] == "Linear"
    effect = fp8_effect("tensorwise", torch.device("cpu"))
    assert effect.unsupported and effect.refused and "torchao" in effect.reason


def test_a_pytorch_older_than_torchao_needs_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if _torchao._release(torch.__version__) >= _torchao.NEEDS_TORCH:
        # a newer PyTorch cannot show an older one: its version string is faked (the floor
        # leg, PyTorch 2.1.2, runs this test for real)
        monkeypatch.setattr(torch, "__version__", "2.1.2")
        monkeypatch.setattr(_torchao, "_loaded", None)
        monkeypatch.setattr(_torchao, "_failed", None)
    net = mlp()
    before = snapshot(net)
    with pytest.raises(LeverUnavailableError) as info:
        with speedflags.fast_math(model=net, fp8=True):
            pytest.fail("the block ran")  # pragma: no cover
    assert (
        f"needs PyTorch 2.11 or newer (torchao 0.18); this is PyTorch {torch.__version__}"
        in str(info.value)
    )
    assert_unchanged(net, before)


@needs_torchao
def test_strict_refuses_the_emulation_on_a_cpu() -> None:
    net = mlp()
    before = snapshot(net)
    with pytest.raises(LeverUnavailableError, match="strict=True refuses") as info:
        with speedflags.fast_math(model=net, fp8=True, strict=True, device="cpu"):
            pytest.fail("the block ran")  # pragma: no cover
    assert "FP8 runs emulated on a CPU" in str(info.value)
    assert_unchanged(net, before)


@pytest.mark.parametrize(("capability", "runs"), [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_the_gpu_needs_sm89(fake_gpu: Any, capability: tuple[int, int], runs: bool) -> None:
    # a CPU build cannot show a GPU: its compute capability is faked (fake_gpu)
    fake_gpu(capability, name="NVIDIA FAKED")
    answer = speedflags.capabilities("cuda").fp8
    assert bool(answer) is runs
    if not runs:
        assert "is sm80; FP8 tensor cores are on NVIDIA GPUs of sm89 (Ada) and newer" in (
            answer.reason
        )
    if _torchao.missing() is not None:
        return
    # what a block on a model whose parameters are on that GPU is told (a block acts where
    # the model's parameters are, and a CPU build can hold none on a GPU)
    effect = fp8_effect("tensorwise", torch.device("cuda"))
    assert effect.effective is runs and effect.refused is not runs
    if not runs:
        assert "sm89" in effect.reason


def test_import_speedflags_never_imports_torchao() -> None:
    code = "import torch, sys, speedflags; print('torchao' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "False"


# --- what the block does ---------------------------------------------------------------------


@needs_torchao
def test_the_emulation_warns_once_per_process() -> None:
    net, x = mlp(), torch.randn(4, D)
    with pytest.warns(SlowPathWarning, match="fp8='tensorwise' on cpu is slower") as said:
        with speedflags.fast_math(model=net, fp8=True):
            net(x)
    assert "emulated on a CPU" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with speedflags.fast_math(model=net, fp8=True):  # a new spec: said already
            net(x)


@needs_torchao
@quiet_emulation
def test_the_large_layers_compute_in_fp8_through_torchao_and_the_rest_stay_as_they_were() -> None:
    from torchao.float8.float8_linear import Float8Linear

    net, x = mlp(), torch.randn(4, D)
    weight = net[0].weight
    with torch.no_grad():
        reference = net.double()(x.double()).float()
    net.float()
    before = snapshot(net)
    with speedflags.fast_math(model=net, fp8=True), Casts() as casts:
        out = net(x)
        assert isinstance(net[0], Float8Linear) and isinstance(net[2], Float8Linear)
        assert net[0].weight is weight  # the same Parameter
        assert type(net[3]) is nn.LayerNorm and type(net[4]) is nn.Linear  # left out
    assert casts.made.count(E4M3) >= 4  # two layers: input and weight of each
    error = float((out.detach() - reference).norm() / reference.norm())
    assert 1e-2 < error < 1e-1  # FP8 (e4m3: 3 mantissa bits), not fp32 or bf16
    assert out.dtype == torch.float32
    assert_unchanged(net, before)
    with torch.no_grad():
        assert torch.equal(net(x), net(x))  # plain float32 again


@needs_torchao
@quiet_emulation
def test_the_block_is_torchaos_own_float8_training_bit_for_bit() -> None:
    from torchao.float8.float8_linear import Float8Linear

    ours, theirs = mlp(small=False), mlp(small=False)
    config = _torchao.config_for("tensorwise", emulate=True)
    for i in (0, 2):  # torchao's own conversion, one way, by hand (no inductor patch)
        theirs[i] = Float8Linear.from_float(theirs[i], config=config)
    x, y = torch.randn(4, D), torch.randn(4, D)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    with speedflags.fast_math(model=ours, fp8=True):
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            for _ in range(2):
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


@needs_torchao
@quiet_emulation
def test_state_dict_is_the_models_own_inside_and_a_checkpoint_saved_there_is_ordinary() -> None:
    net = mlp()
    keys = list(net.state_dict())
    tensors = {k: v.data_ptr() for k, v in net.state_dict().items()}
    with speedflags.fast_math(model=net, fp8=True):
        inside = net.state_dict()
        assert list(inside) == keys
        assert {k: v.data_ptr() for k, v in inside.items()} == tensors
        assert all(v.dtype == torch.float32 for v in inside.values())
        saved, pickled = io.BytesIO(), io.BytesIO()
        torch.save(net.state_dict(), saved)
        torch.save(net, pickled)
        copied = copy.deepcopy(net)
        names = [name for name, _ in net.named_parameters()]
    assert names == [name for name, _ in net.named_parameters()]
    saved.seek(0)
    fresh = mlp()
    fresh.load_state_dict(torch.load(saved))  # an ordinary float32 checkpoint
    pickled.seek(0)
    loaded = torch.load(pickled, weights_only=False)
    for model in (loaded, copied):  # pickled as the layers themselves
        assert kinds(model) == ["Linear", "GELU", "Linear", "LayerNorm", "Linear"]
        assert type(model[0]) is nn.Linear


@needs_torchao
@quiet_emulation
def test_an_exception_inside_restores_the_model() -> None:
    net = mlp()
    before = snapshot(net)
    with pytest.raises(KeyError):
        with speedflags.fast_math(model=net, fp8=True):
            net(torch.randn(2, D))
            raise KeyError("inside")
    assert_unchanged(net, before)


@needs_torchao
@quiet_emulation
def test_nested_blocks_change_the_recipe_and_turn_it_off_then_restore() -> None:
    net = mlp()
    before = snapshot(net)
    with speedflags.fast_math(model=net, fp8=True):
        outer = net[0]
        assert outer.config.cast_config_weight.scaling_granularity.name == "TENSORWISE"
        with speedflags.fast_math(model=net, fp8="rowwise"):
            assert net[0].config.cast_config_weight.scaling_granularity.name == "AXISWISE"
            with speedflags.fast_math(model=net, fp8=False):
                assert_unchanged(net, before)
            assert net[0].config.cast_config_weight.scaling_granularity.name == "AXISWISE"
        assert net[0] is outer  # the same twin again: a compiled model's guards still hold
    assert_unchanged(net, before)


@needs_torchao
@quiet_emulation
def test_a_fused_optimizer_steps_the_float32_parameters_inside_the_block() -> None:
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(8, D), torch.randn(8, 16)
    start = net[0].weight.detach().clone()
    before = snapshot(net)
    losses = []
    with speedflags.fast_math(model=net, fp8=True):
        for _ in range(3):
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            assert net[0].weight.grad is not None and net[0].weight.grad.dtype == torch.float32
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(net[0].weight, start)  # stepped, in float32
    assert_unchanged(net, before, values=False)  # the same objects, classes, dtypes, keys
    stepped = optimizer.param_groups[0]["params"]
    assert all(p is q for p, q in zip(stepped, net.parameters(), strict=True))


@needs_torchao
@quiet_emulation
def test_speedup_enters_it_every_step_and_reuses_the_same_twins() -> None:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    seen: list[nn.Module] = []
    before = snapshot(net)

    @speedflags.speedup(model=net, fp8=True, device="cpu")
    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(net[0])
        loss = net(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for _ in range(3):
        step(torch.randn(4, D))
        assert_unchanged(net, before, values=False)  # between steps: the model's own
    assert len({id(m) for m in seen}) == 1 and type(seen[0]).__name__ == "Float8Linear"
    assert step.stats.calls == 3


@needs_torchao
@quiet_emulation
def test_schedule_entries_take_fp8() -> None:
    net = mlp()
    with speedflags.Schedule({0: {"fp8": True}, 2: {}}, model=net) as schedule:
        schedule.step(0)
        assert kinds(net)[0] == "Float8Linear"
        schedule.step(2)
        assert kinds(net)[0] == "Linear"


@needs_torchao
@quiet_emulation
def test_the_record_says_which_layers_take_part_and_why_the_others_do_not() -> None:
    net = nn.Sequential(mlp(), nn.Linear(16, 16), nn.Linear(D, 8))
    seq = last_seq()
    with speedflags.fast_math(model=net, fp8=True):
        pass
    record = records_since(seq)[0]
    assert record.before == {"model": record.before["model"], "fp8": False}
    assert record.after["fp8"] == {
        "recipe": "tensorwise",
        "converted": 2,
        "left_out": {
            "below the size rule (in and out features of 2048 or more)": 2,
            "features not multiples of 16 (torchao's dimension rule)": 1,
        },
    }
    assert "emulated" in record.reason


@needs_torchao
@quiet_emulation
def test_a_model_that_is_itself_a_linear_has_no_slot_and_the_record_says_so() -> None:
    layer = nn.Linear(D, D)
    seq = last_seq()
    with speedflags.fast_math(model=layer, fp8=True):
        assert type(layer) is nn.Linear
    (record, _) = records_since(seq)
    assert record.after["fp8"]["converted"] == 0
    assert "the model itself" in next(iter(record.after["fp8"]["left_out"]))


@needs_torchao
@quiet_emulation
def test_layers_with_a_forward_of_their_own_lazy_or_read_directly_are_left_out() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    attention = nn.MultiheadAttention(D, 8)
    net = nn.Sequential(Scaled(D, D), nn.LazyLinear(D))
    holder = nn.ModuleList([net, attention])
    seq = last_seq()
    with speedflags.fast_math(model=holder, fp8=True):
        assert type(net[0]) is Scaled and type(net[1]) is nn.LazyLinear
        assert type(attention.out_proj).__name__ == "NonDynamicallyQuantizableLinear"
    left = records_since(seq)[0].after["fp8"]["left_out"]
    assert left == {
        "a class with a forward of its own": 1,
        "not initialised yet (a lazy module)": 1,
        "read directly by its parent (nn.MultiheadAttention)": 1,
    }


@needs_torchao
@quiet_emulation
def test_what_the_block_does_to_a_layer_stays_with_the_layer() -> None:
    net = mlp()
    calls: list[str] = []
    net[0].register_forward_hook(lambda *_: calls.append("before the block"))
    with speedflags.fast_math(model=net, fp8=True):
        net(torch.randn(2, D))
        assert calls == ["before the block"]  # the layer's own hooks fire on its twin
        handle = net[0].register_forward_hook(lambda *_: calls.append("inside"))
        net.eval()
        net[2].weight = nn.Parameter(torch.zeros(D, D))  # assigned inside: the layer's
    assert not net.training and not net[0].training
    assert torch.equal(net[2].weight, torch.zeros(D, D))
    net(torch.randn(2, D))
    assert calls[-2:] == ["before the block", "inside"]
    handle.remove()


@needs_torchao
@quiet_emulation
def test_a_layer_held_twice_gets_one_twin_in_both_places() -> None:
    shared = nn.Linear(D, D)
    net = nn.Sequential(shared, nn.GELU(), shared)
    with speedflags.fast_math(model=net, fp8=True):
        assert net[0] is net[2] and net[0] is not shared
    assert net[0] is shared and net[2] is shared


@needs_torchao
@quiet_emulation
def test_a_block_on_a_part_of_a_model_in_an_fp8_block_keeps_the_outer_twins() -> None:
    net = nn.Sequential(mlp(), nn.Linear(16, 16))
    inner = net[0]
    before = snapshot(net)
    with speedflags.fast_math(model=net, fp8=True):
        twin = inner[0]
        with speedflags.fast_math(model=inner, fp8="rowwise"):
            assert inner[0] is twin  # converted already, by the outer block
        assert inner[0] is twin
    assert_unchanged(net, before)
    with speedflags.fast_math(model=inner, fp8=True):
        twin = inner[0]
        with speedflags.fast_math(model=net, fp8=True):
            assert inner[0] is twin
        assert inner[0] is twin
    assert_unchanged(net, before)


# --- with the other levers -------------------------------------------------------------------


@needs_torchao
@quiet_emulation
@pytest.mark.usefixtures("cpu_with_bf16")
@pytest.mark.parametrize("order", ["one block", "param_dtype inside", "fp8 inside"])
def test_it_composes_with_param_dtype_and_the_layers_left_out_compute_as_it_says(
    order: str,
) -> None:
    net, x = mlp(), torch.randn(4, D)
    before = snapshot(net)
    with contextlib_chain(net, order):
        assert kinds(net)[:3] == ["Float8Linear", "GELU", "Float8Linear"]
        with Casts() as casts:
            out = net(x)
        out.float().pow(2).mean().backward()
    assert E4M3 in casts.made and torch.bfloat16 in casts.made  # the head ran in bf16
    assert out.dtype == torch.float32  # param_dtype's boundary: the input's dtype
    assert net[0].weight.grad is not None and net[0].weight.grad.dtype == torch.float32
    assert_unchanged(net, before)


def contextlib_chain(net: nn.Module, order: str) -> Any:
    import contextlib

    stack = contextlib.ExitStack()
    if order == "one block":
        stack.enter_context(speedflags.fast_math(model=net, param_dtype="bf16", fp8=True))
    elif order == "param_dtype inside":
        stack.enter_context(speedflags.fast_math(model=net, fp8=True))
        stack.enter_context(speedflags.fast_math(model=net, param_dtype="bf16"))
    else:
        stack.enter_context(speedflags.fast_math(model=net, param_dtype="bf16"))
        stack.enter_context(speedflags.fast_math(model=net, fp8=True))
    return stack


@needs_torchao
@quiet_emulation
@pytest.mark.usefixtures("cpu_with_bf16")
def test_it_composes_with_amp() -> None:
    net, x = mlp(), torch.randn(4, D)
    before = snapshot(net)
    with speedflags.fast_math(model=net, fp8=True, amp="bf16", device="cpu"), Casts() as casts:
        out = net(x)
        out.float().sum().backward()
    assert E4M3 in casts.made and out.dtype == torch.bfloat16
    assert net[0].weight.grad is not None and net[0].weight.grad.dtype == torch.float32
    assert_unchanged(net, before, values=False)


# --- inference: the weight's cast made once per parameter version ----------------------------


@needs_torchao
@quiet_emulation
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_grad_each_weights_cast_is_made_once_per_version(mode: str) -> None:
    net, x = mlp(), torch.randn(4, D)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with speedflags.fast_math(model=net, fp8=True):
        with torch.enable_grad():
            uncached = net(x).detach()  # torchao's own forward, casting in the call
        with context():
            first = net(x)
            made = net[0].__dict__["_speedflags_fp8_cast"][2]
            with Casts() as casts:
                again = net(x)
            assert net[0].__dict__["_speedflags_fp8_cast"][2] is made  # reused
            assert casts.made.count(E4M3) == 2  # the two inputs; no weight cast
            assert torch.equal(first, again) and torch.equal(first, uncached)
        with torch.no_grad():
            net[0].weight.mul_(2.0)  # a new version: a new cast
        with context():
            renewed = net(x)
            assert net[0].__dict__["_speedflags_fp8_cast"][2] is not made
            assert not torch.equal(renewed, first)
        twin = net[0]
    assert "_speedflags_fp8_cast" not in twin.__dict__  # no cast outlives the block


# --- torch.compile ----------------------------------------------------------------------------


@needs_torchao
@quiet_emulation
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_model_compiled_before_the_block_follows_it_and_returns_after(backend: str) -> None:
    net, x = mlp(), torch.randn(4, D)
    compiled = torch.compile(net, backend=backend)
    with torch.no_grad():
        outside = compiled(x)
        with speedflags.fast_math(model=net, fp8=True):
            inside, eager = compiled(x), net(x)
        after = compiled(x)
    assert torch.equal(inside, eager)  # FP8, as eager computes it inside
    assert not torch.equal(inside, outside)
    assert torch.equal(after, outside)  # float32 again after


@needs_torchao
@quiet_emulation
def test_a_compiled_training_step_inside_the_block_matches_eager() -> None:
    eager_net, compiled_net = mlp(), mlp()
    x = torch.randn(4, D)

    def step(model: nn.Module) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return model[0].weight.grad.clone()  # type: ignore[union-attr]

    with speedflags.fast_math(model=eager_net, fp8=True):
        expected = step(eager_net)
    with speedflags.fast_math(model=compiled_net, fp8=True):
        got = torch.compile(step, backend="aot_eager")(compiled_net)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7)


# --- torchao's import --------------------------------------------------------------------------


@needs_torchao
def test_torchaos_cpu_build_noise_is_kept_out_of_the_log() -> None:
    code = (
        "import torch, warnings, speedflags\n"
        "warnings.simplefilter('ignore')\n"
        "net = torch.nn.Sequential(torch.nn.Linear(2048, 2048))\n"
        "with speedflags.fast_math(model=net, fp8=True):\n"
        "    net(torch.randn(2, 2048))\n"
        "from speedflags.levers import _torchao\n"
        "print(len(_torchao.import_notes()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    if torch.version.cuda is None and torch.version.hip is None:  # a CPU build: kept out
        assert "Failed to load" not in out.stderr
        assert "is an Enum subclass" not in out.stderr
    assert out.stdout.strip().isdigit()


def test_the_declaration_is_the_registrys() -> None:
    spec = speedflags.levers.registry.lever_spec("fp8")
    assert spec.per_model and spec.baseline is False and spec.ops == ("linear",)
    assert spec.candidates == ("tensorwise", "rowwise")
    assert spec.validate is validate_fp8 and fp8.DECLARED[0] is spec


# --- the tools know the lever ------------------------------------------------------------------


def test_report_says_what_fp8_does_here() -> None:
    from speedflags.report import lever_verdicts

    found = {v["label"]: v for v in lever_verdicts(torch.device("cpu"))}
    for label in ("fp8='tensorwise'", "fp8='rowwise'"):
        verdict = found[label]
        if _torchao.missing() is None:
            assert verdict["status"] == "in effect, emulated: slower"
            assert "emulated on a CPU" in verdict["reason"]
        else:
            assert verdict["status"] == "refused by this PyTorch"
            assert verdict["reason"] == _torchao.missing()


def test_verify_without_torchao_says_refused_with_the_reason(no_torchao: None) -> None:
    run = speedflags.verify("cpu", levers=["fp8"])
    verdict = run.verdict("fp8", "tensorwise")
    assert verdict.status == "refused by this PyTorch" and "torchao" in verdict.reason
    assert run.ok and run.restored


@needs_torchao
def test_verify_on_a_cpu_measures_the_emulation_in_effect_and_slower() -> None:
    run = speedflags.verify("cpu", levers={"fp8": [True]})
    verdict = run.verdict("fp8")
    assert verdict.status == "in effect, emulated: slower", str(run)
    assert verdict.measured["float8_operands"] is True
    assert verdict.measured["arithmetic"] == "fp8" and verdict.measured["slower_factor"] > 0
    assert "cast to float8_e4m3fn" in verdict.figure
    assert run.restored


def test_the_bench_skips_fp8_where_the_size_rule_takes_no_layer() -> None:
    from speedflags._measure.workloads import WORKLOADS
    from speedflags.bench.runner import Settings, run

    for name in ("mlp-train", "linear-infer"):
        workload = WORKLOADS[name]
        assert workload.idle(workload.config("fp8"), 8192) is None
        assert "below the size rule" in (workload.idle(workload.config("fp8"), 1024) or "")
    settings = Settings(
        torch.device("cpu"), ("linear-infer",), sizes=(64,), passes=1, min_rounds=1,
        min_time_s=0.0, warmup_rounds=1, warmup_s=0.0,
    )  # fmt: skip
    (row,) = [r for r in run(settings).results if r.config == "fp8"]
    assert row.skipped == (
        "fp8 takes no layer of Linear(64, 64): below the size rule (in and out features of "
        "2048 or more)"
    )


@needs_torchao
def test_the_bench_marks_fp8_emulated_on_a_cpu_and_says_why_it_is_not_measured_small() -> None:
    from speedflags.bench.runner import Settings, run

    settings = Settings(
        torch.device("cpu"), ("linear-infer",), sizes=(2048,), passes=1, min_rounds=1,
        min_time_s=0.0, warmup_rounds=1, warmup_s=0.0,
    )  # fmt: skip
    rows = [r for r in run(settings).results if r.config == "fp8"]
    assert rows and all(r.skipped for r in rows)
    assert rows[0].skipped.startswith("in effect, emulated: slower: FP8 runs emulated on a CPU")
    assert "not measured: at size 256, where emulated ones are, fp8 takes no layer" in (
        rows[0].skipped
    )


def test_tune_tries_fp8_only_given_the_model_and_says_what_it_is_here() -> None:
    from speedflags._tune.candidates import candidates

    cpu = torch.device("cpu")
    tried, skipped = candidates(cpu, {"fp8": ["tensorwise"]}, model=False)
    assert not tried and skipped[0].note.startswith("skipped (no model)")
    tried, skipped = candidates(cpu, {"fp8": ["tensorwise"]}, model=True)
    assert not tried  # never raced on a CPU: emulated, or refused without torchao
    (row,) = skipped
    if _torchao.missing() is None:
        assert row.verdict == "in effect, emulated: slower"
    else:
        assert row.note.startswith("skipped (refused by this PyTorch)")


@needs_torchao
@quiet_emulation
def test_tune_times_fp8_once_on_a_cpu_and_never_chooses_it() -> None:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    before = snapshot(net)
    result = speedflags.tune(
        step, torch.randn(4, D), budget=0.5, seconds=60, levers={"fp8": [True]}, model=net
    )
    (row,) = [r for r in result.rows if r.levers == {"fp8": "tensorwise"}]
    assert row.verdict == "in effect, emulated: slower"
    assert "fp8" not in result.best and not row.accepted
    assert_unchanged(net, before, values=False)


@needs_torchao
@quiet_emulation
def test_a_fused_optimizer_step_renews_the_inference_cast() -> None:
    # A fused optimizer writes the weights without bumping their version counter: a layer's
    # forward without grad after the step must use the new weights (torchao's own forward,
    # which casts in the call, says what they give), not the cast made before the step.
    net, x = mlp(), torch.randn(4, D)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    with speedflags.fast_math(model=net, fp8=True):
        layer = net[0]
        net(x).pow(2).mean().backward()
        with torch.no_grad():
            before_step = layer(x)  # the weight's cast, made and kept
        version = layer.weight._version
        optimizer.step()
        assert layer.weight._version == version  # unseen by the counter
        with torch.no_grad():
            after_step = layer(x)
        expected = layer(x).detach()  # with grad: torchao's forward, casting in the call
        assert _torchao._step_hook  # steps are counted while twins are in place...
    assert not _torchao._step_hook  # ...and the process-wide hook goes with the block
    assert not torch.equal(before_step, after_step)
    assert torch.equal(after_step, expected)


@needs_torchao
@quiet_emulation
def test_a_recipe_the_installed_torchao_lacks_is_refused_and_the_outer_block_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a torchao without the "rowwise" recipe is faked (this one has it): its list is edited
    loaded = _torchao.load()
    monkeypatch.setattr(loaded, "recipe_names", ("tensorwise",))
    net = mlp()
    before, before_layer = snapshot(net), net[2]
    with speedflags.fast_math(model=net, fp8=True):
        twin = net[0]
        mine = net[2] = nn.Linear(D, D)  # the user's own module, put there inside the block
        with pytest.raises(LeverUnavailableError, match="has no such recipe; it offers"):
            with speedflags.fast_math(model=net, fp8="rowwise"):
                pytest.fail("the block ran")  # pragma: no cover
        assert net[0] is twin and net[2] is mine  # as they were before the inner block
    assert net[2] is mine
    net[2] = before_layer
    assert_unchanged(net, before)
