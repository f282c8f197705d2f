"""Behaviours 7 and 8: autocast is thread-local; levers without effect are recorded or refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import (
    CPU_AUTOCAST_FP16,
    ONEDNN_BF16,
    ZEN3,
    ZEN4,
    autocast_dtype,
    autocast_enabled,
    autocast_nesting,
    needs_cpu_autocast_fp16,
)

import speedflags
from speedflags import LeverUnavailableError, SlowPathWarning, fast_math
from speedflags._hardware import KernelTrial, cpu_features

CPU = speedflags.capabilities("cpu")


@pytest.fixture
def cpu_without_fp16(fake_cpu: Callable[..., None]) -> None:
    """This CPU without fp16 instructions (every AMD CPU): faked where it has them (AMX Xeons)."""
    fake_cpu(dataclasses.replace(cpu_features(), amx_fp16=False, avx512_fp16=False))


# --- behaviour 7 -------------------------------------------------------------------------------


def test_amp_bf16_on_cpu_is_thread_local() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    def look() -> None:
        x = torch.ones(4, 4)
        seen.append((autocast_enabled("cpu"), (x @ x).dtype))

    with fast_math(amp="bf16", device="cpu"):
        assert autocast_enabled("cpu")
        assert autocast_dtype("cpu") == torch.bfloat16
        worker = threading.Thread(target=look)
        worker.start()
        worker.join(30)
        look()
    assert seen == [(False, torch.float32), (True, torch.bfloat16)]
    assert not autocast_enabled("cpu")


def test_amp_false_turns_autocast_off_inside_torch_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fast_math(amp=False, device="cpu"):
            assert not autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert autocast_enabled("cpu")


def test_autocast_nests_with_torch_autocast_and_leaves_its_counter_alone() -> None:
    # torch.autocast's nesting counter (it clears the cast cache when it returns to 0) is
    # left to torch.autocast: speedflags could not put it back exactly after an interruption.
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    assert autocast_nesting() == 0
    with fast_math(amp="bf16", device="cpu"):
        assert autocast_nesting() == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert autocast_nesting() == 1
            assert linear(x).dtype == torch.bfloat16
        assert autocast_nesting() == 0
        assert autocast_enabled("cpu")
    assert autocast_nesting() == 0


def test_casts_cached_in_a_block_are_not_reused_after_it() -> None:
    # The cast cache is keyed by the weight alone: a cast cached in one block must not be
    # used after the weight changed (an optimizer step between two steps' blocks).
    linear = torch.nn.Linear(4, 4, bias=False)
    x = torch.ones(1, 4)
    spec = fast_math(amp="bf16", device="cpu")
    with spec:
        first = linear(x)
        with torch.no_grad():
            linear.weight.add_(1.0)
        assert torch.equal(linear(x), first)  # inside one block the cached cast is reused
    with spec:
        assert not torch.equal(linear(x), first)  # the next block casts the new weight


@needs_cpu_autocast_fp16
def test_amp_fp16_on_this_cpu_follows_its_fp16_answer() -> None:
    before = speedflags.snapshot()
    if CPU.fp16:  # AMX-FP16/AVX512-FP16 and PyTorch's fp16 kernels: fast, applied quietly
        with fast_math(amp="fp16", device="cpu", strict=True):
            assert autocast_dtype("cpu") == torch.float16
    elif CPU.fp16.missing_kernel:  # the instructions, but no fp16 kernels: never applied
        with fast_math(amp="fp16", device="cpu") as frame:
            assert frame.levers == () and not autocast_enabled("cpu")
    else:  # emulated: warned about, applied, refused under strict (test below)
        with pytest.warns(SlowPathWarning, match="fp16 on this CPU is emulated"):
            with fast_math(amp="fp16", device="cpu"):
                assert autocast_dtype("cpu") == torch.float16
    assert speedflags.snapshot() == before


@needs_cpu_autocast_fp16
@pytest.mark.usefixtures("cpu_without_fp16")
def test_amp_fp16_on_cpu_warns_and_strict_refuses() -> None:
    before = speedflags.snapshot()
    with pytest.warns(SlowPathWarning, match="fp16 on this CPU is emulated"):
        with fast_math(amp="fp16", device="cpu"):
            assert autocast_dtype("cpu") == torch.float16
    with pytest.raises(LeverUnavailableError, match="amp='float16'") as excinfo:
        with fast_math(amp="fp16", device="cpu", strict=True):
            pytest.fail("strict must refuse before the block runs")
    assert "Nothing was changed" in str(excinfo.value)
    assert isinstance(excinfo.value, RuntimeError)
    assert speedflags.snapshot() == before


@needs_cpu_autocast_fp16
@pytest.mark.usefixtures("cpu_without_fp16")
def test_the_slow_path_warning_is_emitted_once() -> None:
    with pytest.warns(SlowPathWarning) as caught:
        for _ in range(3):
            with fast_math(amp="fp16", device="cpu"):
                pass
        with speedflags.autocast("fp16", device="cpu"):
            pass
    assert len(caught) == 1


@pytest.mark.skipif(CPU_AUTOCAST_FP16, reason=f"PyTorch {torch.__version__} runs fp16 on CPU")
def test_amp_fp16_that_cpu_autocast_refuses_is_skipped_and_strict_refuses() -> None:
    # PyTorch 2.1's CPU autocast raises for fp16: the lever is not applied, and says why.
    before = speedflags.snapshot()
    with fast_math(amp="fp16", device="cpu") as frame:
        assert frame.levers == ()
        assert speedflags.snapshot() == before
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    skip = [r for r in speedflags.ledger().history if r.lever == "amp"][-1]
    assert skip.action == "skip"  # not "restore": nothing was set
    assert skip.reason == (
        f"amp='float16': PyTorch {torch.__version__}'s CPU autocast runs bf16 only: it refuses fp16"
    )
    with pytest.raises(LeverUnavailableError, match=r"amp='float16': PyTorch .* refuses fp16"):
        with speedflags.autocast("fp16", device="cpu", strict=True):
            pytest.fail("strict must refuse before the block runs")
    assert speedflags.snapshot() == before


@pytest.mark.usefixtures("cpu_with_bf16")  # faked where this CPU lacks the instructions
def test_amp_auto_picks_bf16_on_a_bf16_cpu_and_says_why() -> None:
    with fast_math(amp="auto", device="cpu") as frame:
        assert frame.values == {"amp": "bfloat16"}
        assert autocast_dtype("cpu") == torch.bfloat16
    record = [r for r in speedflags.ledger().history if r.lever == "amp"][-2]
    assert "amp='auto' chose bfloat16" in record.reason


def test_amp_auto_without_native_bf16_records_a_skip(fake_cpu: Callable[..., None]) -> None:
    # A CPU without bf16 instructions (an AVX2-only Zen 3) cannot be had here: faked.
    fake_cpu(ZEN3)
    before = speedflags.snapshot()
    with fast_math(amp="auto", device="cpu") as frame:
        assert frame.levers == ()
        assert speedflags.snapshot() == before
    skip = [r for r in speedflags.ledger().history if r.action == "skip"][-1]
    assert skip.lever == "amp" and "no AVX512-BF16, AMX or Arm BF16 instructions" in skip.reason


def test_amp_bf16_where_pytorch_has_no_bf16_matmul_is_skipped(
    fake_cpu: Callable[..., None],
) -> None:
    # No PyTorch speedflags supports lacks a CPU bf16 matmul; the branch is faked.
    fake_cpu(ZEN4, {torch.bfloat16: KernelTrial("bfloat16", (("matmul", "not implemented"),))})
    before = speedflags.snapshot()
    with fast_math(amp="bf16", device="cpu") as frame:
        assert frame.levers == () and speedflags.snapshot() == before
    skip = [r for r in speedflags.ledger().history if r.action == "skip"][-1]
    assert "but PyTorch" in skip.reason and "has no bfloat16 matmul on CPU" in skip.reason
    with pytest.raises(LeverUnavailableError, match="has no bfloat16 matmul"):
        with fast_math(amp="bf16", device="cpu", strict=True):
            pytest.fail("strict must refuse")


# --- behaviour 8 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [dict(tf32=True), dict(tf32=False), dict(cudnn_benchmark=True), dict(matmul_precision="high")],
    ids=["tf32", "tf32-off", "benchmark", "high"],
)
def test_no_effect_here_is_applied_recorded_and_strict_refuses(kwargs: dict) -> None:
    before = speedflags.snapshot()
    with fast_math(device="cpu", **kwargs):
        assert speedflags.snapshot() != before or kwargs == dict(tf32=False)
    record = speedflags.ledger().history[-2]
    assert record.action == "set"
    assert "no effect on cpu" in record.reason
    with pytest.raises(LeverUnavailableError) as excinfo:
        with fast_math(device="cpu", strict=True, **kwargs):
            pytest.fail("strict must refuse")
    assert "no effect on cpu" in str(excinfo.value)
    assert speedflags.snapshot() == before


def test_strict_accepts_what_works_on_this_device() -> None:
    with fast_math(sdpa="flash", device="cpu", strict=True):  # the CPU flash kernel runs anywhere
        sdpa = speedflags.snapshot()["sdpa"]
        assert sdpa["flash"] and sdpa["math"] and not sdpa["efficient"]


@pytest.mark.usefixtures("cpu_with_bf16")
def test_strict_accepts_medium_precision_on_a_cpu_with_bf16() -> None:
    with fast_math(matmul_precision="medium", sdpa="flash", device="cpu", strict=True):
        assert torch.get_float32_matmul_precision() == "medium"


def test_strict_refuses_medium_where_onednn_has_no_bf16_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ONEDNN_BF16:  # an AVX-512 or AMX CPU: PyTorch's answer is faked to an AVX2 CPU's
        from speedflags.levers import precision

        monkeypatch.setattr(precision, "_onednn_bf16", lambda: False)
    with pytest.raises(LeverUnavailableError, match="oneDNN bf16 matmul is not available here"):
        with fast_math(matmul_precision="medium", device="cpu", strict=True):
            pytest.fail("strict must refuse")


def test_tf32_is_effective_on_an_ampere_gpu(fake_gpu) -> None:
    fake_gpu((8, 0))
    spec = fast_math(tf32=True, device="cuda", strict=True)
    with spec:
        assert torch.backends.cuda.matmul.allow_tf32
    record = speedflags.ledger().history[-2]
    assert record.reason == ""  # effective: nothing to explain


def test_tf32_on_a_turing_gpu_is_recorded_as_no_effect(fake_gpu) -> None:
    fake_gpu((7, 5), "Tesla T4")
    with fast_math(tf32=True, device="cuda"):
        pass
    assert "Tesla T4 is sm75; TF32 needs Ampere (sm80)" in speedflags.ledger().history[-2].reason
    with pytest.raises(LeverUnavailableError, match="sm75"):
        with fast_math(tf32=True, device="cuda", strict=True):
            pass


# --- emulated bf16 and a device this PyTorch cannot use are never silent ----------------------


def _speedflags_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, speedflags.SpeedflagsWarning)
    ]


def test_amp_bf16_on_a_cpu_without_bf16_instructions_warns_once_with_the_cost(
    fake_cpu: Callable[..., None],
) -> None:
    # Failed before: silent, and a 1024x1024 matmul ran 50x slower than fp32 there. The CPU
    # is faked to an AVX2 Zen 3 (instructions alone decide: no bf16 kernel trial is needed);
    # the arithmetic is real.
    fake_cpu(ZEN3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for spec in (fast_math(amp="bf16", device="cpu"), fast_math(amp=torch.bfloat16)):
            for _ in range(3):
                with spec:
                    assert autocast_dtype("cpu") == torch.bfloat16  # applied all the same
        with speedflags.autocast("bf16", device="cpu"):
            pass

        @speedflags.speedup(amp="BF16", device="cpu")
        def step() -> None:
            pass

        step()
    said = _speedflags_warnings(caught)
    assert len(said) == 1, said
    assert said[0].startswith("SlowPathWarning: amp='bfloat16' on cpu is slower than without it")
    assert "tens of times slower than fp32" in said[0] and "strict=True refuses it" in said[0]
    with pytest.raises(LeverUnavailableError, match="emulated"):
        with fast_math(amp="bf16", device="cpu", strict=True):
            pytest.fail("strict must refuse an emulated lever")


AMX_ONLY = dataclasses.replace(ZEN4, avx512_bf16=False, amx_bf16=True)


@pytest.mark.parametrize("features", [ZEN4, AMX_ONLY], ids=["zen4", "amx"])
def test_amp_bf16_on_a_cpu_with_bf16_instructions_never_warns(
    fake_cpu: Callable[..., None], features: object
) -> None:
    fake_cpu(features, {torch.bfloat16: KernelTrial("bfloat16")})  # faked: and the kernels run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with fast_math(amp="bf16", device="cpu", strict=True):
                assert autocast_dtype("cpu") == torch.bfloat16
    assert _speedflags_warnings(caught) == []


WARNINGS_OF_A_PROCESS = """
import warnings
warnings.simplefilter("always")
import speedflags
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        with speedflags.fast_math(amp="bf16", device="cpu"):
            pass
    with speedflags.fast_math(amp="bfloat16", device="cpu", label="another spec"):
        pass
said = [w for w in caught if issubclass(w.category, speedflags.SlowPathWarning)]
print(len(said), bool(speedflags.capabilities("cpu").bf16))
"""


def test_one_process_on_this_cpu_warns_exactly_once_where_bf16_is_emulated() -> None:
    # This CPU and this PyTorch, unfaked, in a process of its own: once on a CPU without bf16
    # instructions (an AVX2 EPYC), never on one with them (Zen 4/5, AMX Xeons).
    out = subprocess.run(
        [sys.executable, "-c", WARNINGS_OF_A_PROCESS],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.split()  # fmt: skip
    count, native = int(out[0]), out[1] == "True"
    assert count == (0 if native else 1), out
    assert native == bool(CPU.bf16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("levers", [dict(amp="bf16"), dict(tf32=True), dict(amp="auto")])
def test_a_cuda_lever_without_cuda_warns_as_torch_autocast_does(levers: dict) -> None:
    # Failed before: fast_math(amp="bf16", device="cuda") did nothing and said nothing here.
    before = speedflags.snapshot()
    name = next(iter(levers))
    if levers.get("amp") == "auto":  # "auto" finds no dtype on a missing device: nothing set
        with pytest.warns(speedflags.DeviceUnavailableWarning, match="its levers change nothing"):
            with fast_math(device="cuda", **levers) as frame:
                assert frame.levers == ()
        return
    with pytest.warns(speedflags.DeviceUnavailableWarning) as caught:
        for _ in range(2):
            with fast_math(device="cuda", **levers):
                pass
    assert len(caught) == 1
    said = str(caught[0].message)
    assert f"{name}=" in said and "on cuda: CUDA is not available here" in said
    assert "changes nothing" in said and "strict=True refuses it" in said
    assert ("torch.autocast('cuda')" in said) == (name == "amp")
    with pytest.raises(LeverUnavailableError, match="CUDA is not available"):
        with fast_math(device="cuda", strict=True, **levers):
            pytest.fail("strict must refuse")
    assert speedflags.snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_bare_block_for_cuda_without_cuda_warns_too() -> None:
    with pytest.warns(speedflags.DeviceUnavailableWarning, match="its levers change nothing"):
        with fast_math(device="cuda", label="the recommended levers") as frame:
            assert frame.levers == ()
