"""Behaviours 7 and 8: autocast is thread-local; levers without effect are recorded or refused."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch
from conftest import autocast_nesting

import speedflags
from speedflags import LeverUnavailableError, SlowPathWarning, fast_math
from speedflags.levers.registry import lever_spec

CPU = speedflags.capabilities("cpu")
needs_cpu_bf16 = pytest.mark.skipif(not CPU.cpu_bf16, reason=f"this CPU: {CPU.cpu_bf16.reason}")


# --- behaviour 7 -------------------------------------------------------------------------------


def test_amp_bf16_on_cpu_is_thread_local() -> None:
    seen: List[tuple[bool, torch.dtype]] = []

    def look() -> None:
        x = torch.ones(4, 4)
        seen.append((torch.is_autocast_enabled("cpu"), (x @ x).dtype))

    with fast_math(amp="bf16", device="cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        worker = threading.Thread(target=look)
        worker.start()
        worker.join()
        look()
    assert seen == [(False, torch.float32), (True, torch.bfloat16)]
    assert not torch.is_autocast_enabled("cpu")


def test_amp_false_turns_autocast_off_inside_torch_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fast_math(amp=False, device="cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


def test_autocast_nests_with_torch_autocast_and_clears_its_cache() -> None:
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    assert autocast_nesting() == 0
    with fast_math(amp="bf16", device="cpu"):
        assert autocast_nesting() == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert autocast_nesting() == 2
            linear(x)
        assert autocast_nesting() == 1
    assert autocast_nesting() == 0


def test_amp_fp16_on_cpu_warns_and_strict_refuses() -> None:
    if CPU.fp16:
        pytest.skip("this CPU has native fp16 (AMX-FP16/AVX512-FP16): fp16 autocast is fast here")
    before = speedflags.snapshot()
    with pytest.warns(SlowPathWarning, match="fp16 on this CPU is emulated"):
        with fast_math(amp="fp16", device="cpu"):
            assert torch.get_autocast_dtype("cpu") == torch.float16
    with pytest.raises(LeverUnavailableError, match="amp='float16'") as excinfo:
        with fast_math(amp="fp16", device="cpu", strict=True):
            pytest.fail("strict must refuse before the block runs")
    assert "Nothing was changed" in str(excinfo.value)
    assert isinstance(excinfo.value, RuntimeError)
    assert speedflags.snapshot() == before


def test_the_slow_path_warning_is_emitted_once() -> None:
    if CPU.fp16:
        pytest.skip("this CPU has native fp16")
    with pytest.warns(SlowPathWarning) as caught:
        for _ in range(3):
            with fast_math(amp="fp16", device="cpu"):
                pass
        with speedflags.autocast("fp16", device="cpu"):
            pass
    assert len(caught) == 1


@needs_cpu_bf16
def test_amp_auto_picks_bf16_on_this_cpu_and_says_why() -> None:
    with fast_math(amp="auto", device="cpu") as frame:
        assert frame.values == {"amp": "bfloat16"}
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    record = [r for r in speedflags.ledger().history if r.lever == "amp"][-2]
    assert "amp='auto' chose bfloat16" in record.reason


def test_amp_auto_without_native_bf16_records_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU without bf16 instructions cannot be had here: fake the answer (only that).
    from speedflags import hardware

    monkeypatch.setattr(
        hardware, "_host_cpu_bf16", lambda: hardware.Capability(False, "no bf16 (faked)")
    )
    hardware._clear_cache()
    try:
        before = speedflags.snapshot()
        with fast_math(amp="auto", device="cpu") as frame:
            assert frame.levers == ()
            assert speedflags.snapshot() == before
        skip = [r for r in speedflags.ledger().history if r.action == "skip"][-1]
        assert skip.lever == "amp" and "no bf16 (faked)" in skip.reason
    finally:
        hardware._clear_cache()


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
    levers: Dict[str, Any] = {"sdpa": "flash"}
    medium = lever_spec("matmul_precision").lever().available("medium", torch.device("cpu"))
    if medium.effective:  # oneDNN's bf16 matmul route: not on every CPU (none on AVX2 only)
        levers["matmul_precision"] = "medium"
    with fast_math(**levers, device="cpu", strict=True):
        assert torch.get_float32_matmul_precision() == levers.get("matmul_precision", "highest")
        assert torch.backends.cuda.flash_sdp_enabled()


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
