"""capabilities() and recommended(): real answers for this CPU, faked GPUs for the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from conftest import autocast_dtype, autocast_enabled

import speedflags
from speedflags import InvalidValueError, capabilities, fast_math, recommended
from speedflags._hardware import cpu_kernels


def cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_cpu_answers_match_the_cpu() -> None:
    caps = capabilities("cpu")
    assert caps.device == "cpu"
    assert caps.compute_capability is None
    assert not caps.tf32
    assert "Ampere" in caps.tf32.reason
    flags = cpuinfo_flags()
    if flags:  # independent check against the kernel's view of the CPU
        has_bf16 = bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)
        # and PyTorch must run bf16 matmuls on it (tests/test_hardware_cpu.py checks the trial)
        runs = cpu_kernels(torch.bfloat16).runs
        assert bool(caps.cpu_bf16) is (has_bf16 and runs)
        assert bool(caps.bf16) is (has_bf16 and runs)
        has_fp16 = bool({"avx512_fp16", "amx_fp16"} & flags)
        assert bool(caps.fp16) is (has_fp16 and cpu_kernels(torch.float16).runs)
    assert caps.flash_sdpa
    assert not caps.efficient_sdpa
    assert not caps.cudnn_sdpa
    json.dumps(caps.to_dict())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU is present")
def test_cuda_without_a_gpu_says_why() -> None:
    caps = capabilities("cuda")
    assert not caps.tf32
    assert not caps.bf16
    assert "CUDA is not available" in caps.tf32.reason


@pytest.mark.parametrize(
    ("capability", "name", "tf32", "bf16", "fp16", "flash"),
    [
        ((9, 0), "NVIDIA H100 80GB HBM3", True, True, True, True),
        ((8, 0), "NVIDIA A100-SXM4-80GB", True, True, True, True),
        ((8, 9), "NVIDIA GeForce RTX 4050 Laptop GPU", True, True, True, True),
        ((7, 5), "Tesla T4", False, False, True, False),
        ((7, 0), "Tesla V100-SXM2-16GB", False, False, True, False),
        ((6, 0), "Tesla P100-PCIE-16GB", False, False, True, False),
    ],
)
def test_gpu_answers_follow_the_compute_capability(
    fake_gpu: Any, capability: Any, name: str, tf32: bool, bf16: bool, fp16: bool, flash: bool
) -> None:
    fake_gpu(capability, name)
    caps = capabilities("cuda")
    assert caps.device == "cuda:0"
    assert caps.name == name
    assert caps.compute_capability == capability
    assert (bool(caps.tf32), bool(caps.bf16), bool(caps.fp16), bool(caps.flash_sdpa)) == (
        tf32,
        bf16,
        fp16,
        flash,
    )
    assert f"sm{capability[0]}{capability[1]}" in caps.tf32.reason
    assert caps.efficient_sdpa


def test_native_bf16_is_not_emulated_bf16(fake_gpu: Any) -> None:
    # torch.cuda.is_bf16_supported() says True on a T4 (emulation); speedflags says no.
    fake_gpu((7, 5), "Tesla T4")
    assert not capabilities("cuda").bf16
    assert "emulate" in capabilities("cuda").bf16.reason


def test_nvidia_tf32_override_disables_tf32(fake_gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    fake_gpu((8, 0))
    caps = capabilities("cuda")
    assert not caps.tf32
    assert "NVIDIA_TF32_OVERRIDE=0" in caps.tf32.reason


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((8, 0), {"tf32": True, "amp": "bf16"}), ((7, 5), {"amp": "fp16"}), ((6, 1), {})],
)
def test_recommended_levers_per_gpu(fake_gpu: Any, capability: Any, expected: dict) -> None:
    fake_gpu(capability)
    rec = recommended("cuda")
    assert rec.levers == expected
    assert set(rec.reasons) == (set(expected) or {"*"})


def test_recommended_on_this_cpu() -> None:
    rec = recommended("cpu")
    assert rec.levers == ({"amp": "bf16"} if capabilities("cpu").cpu_bf16 else {})


def test_bare_fast_math_on_an_ampere_gpu_applies_tf32_and_bf16(fake_gpu: Any) -> None:
    fake_gpu((8, 0))
    before = speedflags.snapshot()
    with fast_math(device="cuda") as frame:
        assert frame.values == {"tf32": True, "amp": "bfloat16"}
        assert torch.backends.cuda.matmul.allow_tf32
        assert autocast_enabled("cuda")
        assert autocast_dtype("cuda") == torch.bfloat16
    assert speedflags.snapshot() == before
    reasons = [r.reason for r in speedflags.ledger().history[-4:-2]]
    assert all(reason.startswith("recommended:") for reason in reasons)


def test_bad_device_names_the_call() -> None:
    with pytest.raises(InvalidValueError, match=r"capabilities\(device='gpu'\)"):
        capabilities("gpu")
    with pytest.raises(InvalidValueError, match=r"recommended\(device='tpu:0'\)"):
        recommended("tpu:0")


def test_capability_is_truthy_like_its_answer() -> None:
    yes, no = speedflags.Capability(True, "a"), speedflags.Capability(False, "b")
    assert yes and not no


def test_capabilities_are_cached_per_device() -> None:
    assert capabilities("cpu") is capabilities("cpu")
    assert capabilities(None) is capabilities(speedflags._hardware.default_device())
