"""speedflags._measure.configs: each configuration is a real fast_math frame over the baseline.

GPU answers (which configurations an A100 or a T4 can run) use the ``fake_gpu`` fixture:
a CPU build cannot show a compute capability, so only ``capabilities`` is faked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    AMX_XEON,
    CPU_AUTOCAST_FP16,
    TORCH_2_1_KERNELS,
    ZEN3,
    autocast_enabled,
)

import speedflags
from speedflags._hardware import cpu_kernels
from speedflags._measure.configs import BASELINE_LEVERS, Config
from speedflags._measure.route import medium_route
from speedflags._measure.workloads import MATMUL_CONFIGS, WORKLOADS
from speedflags.levers import precision

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
BY_NAME = {c.name: c for c in MATMUL_CONFIGS}


def test_baseline_frame_sets_fp32_even_if_the_process_had_fast_paths_on() -> None:
    with speedflags.fast_math(matmul_precision="medium", amp="bf16", device="cpu"):
        with BY_NAME["fp32"].frames(CPU):
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert autocast_enabled("cpu") is False
            assert torch.backends.cudnn.benchmark is False
        assert torch.get_float32_matmul_precision() == "medium"
        assert autocast_enabled("cpu") is True


@pytest.mark.usefixtures("fresh_history")  # a full ring keeps its length
def test_configuration_frame_nests_inside_the_baseline_and_restores() -> None:
    before = speedflags.snapshot()
    history = len(speedflags.ledger().history)
    with BY_NAME["precision-medium"].frames(CPU):
        assert torch.get_float32_matmul_precision() == "medium"
        labels = [f.label for f in speedflags.ledger().open_frames()]
        assert labels == [
            "speedflags bench precision-medium (baseline)",
            "speedflags bench precision-medium",
        ]
    assert speedflags.snapshot() == before
    assert len(speedflags.ledger().history) > history  # recorded like any user frame


def test_frames_restore_on_keyboard_interrupt() -> None:
    before = speedflags.snapshot()
    with pytest.raises(KeyboardInterrupt), BY_NAME["amp-bf16"].frames(CPU):
        assert autocast_enabled("cpu")
        raise KeyboardInterrupt
    assert speedflags.snapshot() == before
    assert not speedflags.ledger().open_frames()


def test_pure_dtype_configuration_opens_only_the_baseline_frame() -> None:
    with BY_NAME["pure-bf16"].frames(CPU):
        assert len(speedflags.ledger().open_frames()) == 1


@pytest.mark.parametrize(
    ("name", "described", "precision"),
    [
        ("fp32", "fp32, TF32 off, matmul precision 'highest'", "fp32"),
        ("tf32", "fast_math(tf32=True)", "tf32"),
        ("precision-high", "fast_math(matmul_precision='high')", "tf32"),
        ("precision-medium", "fast_math(matmul_precision='medium')", "bf16"),
        ("amp-fp16", "fast_math(amp='fp16')", "fp16"),
        ("pure-bf16", "bf16 inputs and weights", "bf16"),
        ("pure-fp16", "fp16 inputs and weights", "fp16"),
    ],
)
def test_describe_and_precision(name: str, described: str, precision: str) -> None:
    assert BY_NAME[name].describe() == described
    assert BY_NAME[name].precision == precision
    # on CUDA the same, but "medium": cuBLAS computes it in TF32 (measured on an H200)
    on_cuda = "tf32" if name == "precision-medium" else precision
    assert BY_NAME[name].arithmetic("cuda") == on_cuda


def test_baseline_levers_are_a_valid_fast_math_spec() -> None:
    assert speedflags.fast_math(**BASELINE_LEVERS).levers == {
        "tf32": False,
        "matmul_precision": "highest",
        "cudnn_benchmark": False,
        "deterministic": False,
        "reduced_precision_reduction": False,
        "amp": False,
    }


# This CPU, and the CPUs CI runs on faked (conftest's fake_cpu): an AMX Xeon with this
# PyTorch's real kernels and with PyTorch 2.1.2's (fp16 instructions, no fp16 CPU matmul), an AVX2
# Zen 3. Each expectation follows the capability answer, so every branch runs everywhere.
CPU_KINDS = {
    "this-cpu": None,
    "amx-xeon": (AMX_XEON,),  # this PyTorch's real kernels
    "amx-xeon-torch-2.1": (AMX_XEON, TORCH_2_1_KERNELS),
    "zen3": (ZEN3, {}, None, False),  # AVX2: PyTorch's oneDNN bf16 check says no too
}


@pytest.mark.parametrize("kind", list(CPU_KINDS))
def test_cpu_skips_with_reasons(fake_cpu: Callable[..., None], kind: str) -> None:
    if CPU_KINDS[kind] is not None:
        fake_cpu(*CPU_KINDS[kind])
    caps = speedflags.capabilities("cpu")
    reasons = {c.name: c.unavailable(CPU) for c in MATMUL_CONFIGS}
    assert reasons["fp32"] is None
    assert "TF32 is a tensor-core mode" in str(reasons["tf32"])
    assert "'high' only enables TF32" in str(reasons["precision-high"])
    if not CPU_AUTOCAST_FP16:  # PyTorch 2.1's CPU autocast refuses fp16, whatever the CPU
        assert "CPU autocast runs bf16 only: it refuses fp16" in str(reasons["amp-fp16"])
    elif caps.fp16:  # AMX-FP16/AVX512-FP16 and PyTorch's fp16 kernels
        assert reasons["amp-fp16"] is None
    else:  # emulated (slower), or refused by PyTorch's kernels
        assert str(reasons["amp-fp16"]) == f"fp16 is not native on cpu: {caps.fp16.reason}"
    if caps.fp16:
        assert reasons["pure-fp16"] is None
    elif caps.fp16.missing_kernel:
        assert reasons["pure-fp16"] == f"fp16 does not run here: {caps.fp16.reason}"
        assert "has no float16 matmul on CPU" in caps.fp16.reason
    else:
        assert reasons["pure-fp16"] == f"no native fp16: {caps.fp16.reason}"
    route = medium_route()  # found by trying (a fake AMX Xeon keeps this machine's route)
    if not precision._onednn_bf16():  # no AVX-512: PyTorch's check says no oneDNN bf16 route
        assert "oneDNN bf16 matmul is not available here" in str(reasons["precision-medium"])
    elif route.effective:  # oneDNN's route: bf16 arithmetic with AMX, fp32 without
        assert reasons["precision-medium"] is None
    else:  # a PyTorch without the route (2.1): the same kernel as 'highest'
        assert reasons["precision-medium"] == f"no effect on cpu: {route.reason}"
    assert (reasons["amp-bf16"] is None) == caps.bf16.supported
    assert (reasons["pure-bf16"] is None) == caps.bf16.supported
    if kind == "amx-xeon" and cpu_kernels(torch.float16).runs:  # and a recent PyTorch
        assert reasons["amp-bf16"] is reasons["pure-bf16"] is reasons["pure-fp16"] is None
    if kind == "amx-xeon-torch-2.1":  # and on PyTorch 2.1: the fp16 rows skipped, with why
        assert "but PyTorch" in str(reasons["pure-fp16"])
        assert reasons["pure-bf16"] is None


@pytest.mark.usefixtures("cpu_with_bf16")  # faked where this CPU has no bf16 instructions
def test_a_configuration_with_one_effective_lever_runs_and_notes_the_other() -> None:
    combined = WORKLOADS["mlp-train"].config("tf32+amp-bf16")
    assert combined.unavailable(CPU) is None
    (note,) = combined.notes(CPU)
    assert note.startswith("tf32: no effect on cpu")


def test_ampere_gpu_runs_every_matmul_configuration(fake_gpu: Callable[..., None]) -> None:
    fake_gpu((8, 0))
    assert {c.name: c.unavailable(CUDA) for c in MATMUL_CONFIGS} == dict.fromkeys(BY_NAME)
    assert BY_NAME["tf32"].notes(CUDA) == ()


def test_turing_gpu_skips_tf32_and_bf16(fake_gpu: Callable[..., Any]) -> None:
    fake_gpu((7, 5), name="Tesla T4")
    reasons = {c.name: c.unavailable(CUDA) for c in MATMUL_CONFIGS}
    assert "TF32 needs Ampere" in str(reasons["tf32"])
    assert "TF32 needs Ampere" in str(reasons["precision-medium"])
    assert "bf16 is not native" in str(reasons["amp-bf16"])
    assert "native bf16 needs sm80" in str(reasons["pure-bf16"])
    assert reasons["amp-fp16"] is None
    assert reasons["pure-fp16"] is None


def test_cudnn_benchmark_skips_on_cpu_and_runs_on_a_gpu(fake_gpu: Callable[..., Any]) -> None:
    config = Config("cudnn-benchmark", {"cudnn_benchmark": True})
    assert "cuDNN autotuning is for CUDA" in str(config.unavailable(CPU))
    fake_gpu((9, 0), name="NVIDIA H100 80GB HBM3")
    assert config.unavailable(CUDA) is None
