"""A CPU capability is the instructions *and* what the installed PyTorch runs, found by trying.

The real answers for this CPU and this PyTorch are checked against independent evidence (the
operations tried in the test itself). The other CPUs CI runs on cannot be had here, so their
answers are faked in the caches speedflags keeps them in (conftest's ``fake_cpu``): an Intel
Xeon with AMX-BF16, AMX-FP16 and AVX512-FP16, an AMD Zen 4 (AVX512-BF16, no AMX) and a Zen 3
(AVX2), with this PyTorch's kernels or PyTorch 2.1.2's (no CPU float16 matmul, no bfloat16
``mse_loss``). So every branch runs on every machine; the arithmetic stays real.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ALL_KERNELS,
    AMX_XEON,
    CPU_AUTOCAST_FP16,
    TORCH_2_1_KERNELS,
    ZEN3,
    ZEN4,
    autocast_dtype,
    autocast_enabled,
)

import speedflags
from speedflags import (
    LeverUnavailableError,
    SlowPathWarning,
    capabilities,
    fast_math,
    recommended,
)
from speedflags._hardware import KernelTrial, cpu_features, cpu_kernels
from speedflags._hardware import cpu as hardware_cpu
from speedflags._measure.evidence import aten_ops
from speedflags._measure.workloads import MATMUL_CONFIGS
from speedflags._tune.candidates import candidates
from speedflags.levers.registry import lever_spec
from speedflags.report import build_report

CPU = torch.device("cpu")
DTYPES = (torch.bfloat16, torch.float16)
VERSION = torch.__version__


def _runs(operation: Callable[[], Any]) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch 2.1 warns that its fp16 mse kernel is slow
        try:
            operation()
        except (RuntimeError, NotImplementedError):
            return False
    return True


# --- this CPU, this PyTorch -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_the_trial_agrees_with_trying_the_operations_here(dtype: torch.dtype) -> None:
    trial = hardware_cpu.try_cpu_kernels(dtype)
    a = torch.ones(3, 3, dtype=dtype)
    matmul = _runs(lambda: a @ a)
    assert (trial.missing_one(("matmul",)) is None) is matmul
    assert trial.runs is (
        matmul and _runs(lambda: F.linear(a, a.requires_grad_()).sum().backward())
    )
    if trial.runs:  # the loss is tried only where the dtype runs
        loss = _runs(lambda: F.mse_loss(a.detach(), a.detach() * 2))
        assert (trial.missing_one(("mse_loss",)) is None) is loss
    assert cpu_kernels(dtype) == trial  # the cached answer is the same trial's


def test_the_trial_neither_sees_nor_touches_the_callers_thread_state() -> None:
    # Under the caller's bf16 autocast a float16 matmul would be cast to bf16 and a missing
    # float16 kernel hidden; under no_grad the backward could not run. The trial runs in a
    # thread of its own: nothing of it dispatches here, and the answer is the plain one.
    plain = hardware_cpu.try_cpu_kernels(torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        trial, ops = aten_ops(lambda: hardware_cpu.try_cpu_kernels(torch.float16))
        assert autocast_enabled("cpu") and autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_grad_enabled()
    assert trial == plain
    assert ops == frozenset()


def test_a_warning_is_a_run_and_an_exception_a_missing_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def warns(dtype: torch.dtype) -> None:
        warnings.warn("this kernel is slow", UserWarning, stacklevel=1)

    def raises(dtype: torch.dtype) -> None:
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\nmore detail")

    monkeypatch.setattr(
        hardware_cpu, "_OPERATIONS", (("matmul", warns), ("linear backward", raises))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under -W error: the warning is raised
        trial = hardware_cpu.try_cpu_kernels(torch.float16)
    assert trial == KernelTrial(
        "float16", (("linear backward", "\"addmm_impl_cpu_\" not implemented for 'Half'"),)
    )
    assert not trial.runs


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_this_cpus_answer_is_its_instructions_and_its_kernels(dtype: torch.dtype) -> None:
    caps = capabilities("cpu")
    cap = caps.bf16 if dtype == torch.bfloat16 else caps.fp16
    features = cpu_features()
    has = features.bf16_instructions() if dtype == torch.bfloat16 else features.fp16_instructions()
    if not has:  # e.g. AVX2-only EPYCs; fp16 on every AMD CPU
        assert not cap and not cap.missing_kernel and "emulated" in cap.reason
    elif not cpu_kernels(dtype).runs:  # e.g. an AMX-FP16 Xeon with PyTorch 2.1
        assert not cap and cap.missing_kernel
        assert f"the CPU has {has}, but PyTorch {VERSION} has no" in cap.reason
    else:
        assert cap and cap.reason.startswith(f"the CPU has {has}, and PyTorch {VERSION} runs")
    if dtype == torch.bfloat16:
        assert caps.cpu_bf16 is caps.bf16  # one answer for the host CPU


# --- the CPUs CI runs on, faked ------------------------------------------------------------

CASES: dict[str, Any] = {
    # name: (features, kernels, bf16 supported, fp16 supported, fp16 missing_kernel)
    "amx-xeon": (AMX_XEON, ALL_KERNELS, True, True, False),
    "amx-xeon-torch-2.1": (AMX_XEON, TORCH_2_1_KERNELS, True, False, True),
    "zen4": (ZEN4, ALL_KERNELS, True, False, False),
    "zen3-torch-2.1": (ZEN3, TORCH_2_1_KERNELS, False, False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_cpu_kind_gets_the_answer_and_the_reason(
    fake_cpu: Callable[..., None], case: str
) -> None:
    features, kernels, bf16, fp16, fp16_missing = CASES[case]
    fake_cpu(features, kernels)
    caps = capabilities("cpu")
    assert caps.name == features.name
    assert (bool(caps.bf16), bool(caps.fp16), caps.fp16.missing_kernel) == (
        bf16,
        fp16,
        fp16_missing,
    )
    assert recommended("cpu").levers == ({"amp": "bf16"} if bf16 else {})
    if case == "amx-xeon":
        assert caps.bf16.reason == (
            f"the CPU has AMX tiles (AMX-BF16), and PyTorch {VERSION} runs bfloat16 matmuls on it"
        )
        assert caps.fp16.reason.startswith("the CPU has AMX-FP16 and AVX512-FP16 instructions")
    elif case == "amx-xeon-torch-2.1":
        assert caps.fp16.reason == (
            f"the CPU has AMX-FP16 and AVX512-FP16 instructions, but PyTorch {VERSION} has no "
            "float16 matmul on CPU (\"addmm_impl_cpu_\" not implemented for 'Half')"
        )
        assert "(but no bfloat16 mse_loss: keep losses in float32" in caps.bf16.reason
    elif case == "zen4":
        assert "AVX512-BF16" in caps.bf16.reason and "emulated" in caps.fp16.reason
    else:
        assert caps.bf16.reason.startswith("no AVX512-BF16, AMX or Arm BF16 instructions")


@pytest.mark.parametrize("case", list(CASES))
def test_fp16_autocast_follows_the_answer(fake_cpu: Callable[..., None], case: str) -> None:
    features, kernels, _, fp16, fp16_missing = CASES[case]
    fake_cpu(features, kernels)
    effect = lever_spec("amp").lever("cpu").available(torch.float16, CPU)
    if not CPU_AUTOCAST_FP16:  # PyTorch 2.1's CPU autocast refuses fp16 before any kernel
        assert effect.unsupported and "refuses fp16" in effect.reason
    elif fp16:
        assert effect.effective and not effect.slow
    elif fp16_missing:  # refused, never applied: the first fp16 matmul would raise
        assert effect.unsupported and not effect.slow
        assert "has no float16 matmul on CPU" in effect.reason
    else:
        assert effect.slow and "emulated" in effect.reason
    before = speedflags.snapshot()
    if effect.effective:
        with fast_math(amp="fp16", device="cpu", strict=True):
            assert autocast_dtype("cpu") == torch.float16
    else:
        # strict refuses, and the refusal says why: no SlowPathWarning on top of it
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowPathWarning)
            with pytest.raises(LeverUnavailableError, match="amp='float16'"):
                with fast_math(amp="fp16", device="cpu", strict=True):
                    pytest.fail("strict must refuse before the block runs")
    if effect.slow:  # without strict: applied, and the cost said once
        with pytest.warns(SlowPathWarning, match="amp='float16' on cpu is slower than without"):
            with fast_math(amp="fp16", device="cpu"):
                assert autocast_dtype("cpu") == torch.float16
    if effect.unsupported:  # applied nowhere, strict or not, and recorded as skipped
        with fast_math(amp="fp16", device="cpu") as frame:
            assert frame.levers == () and not autocast_enabled("cpu")
    assert speedflags.snapshot() == before


def test_every_tool_reads_the_one_answer_on_an_amx_xeon_with_pytorch_2_1(
    fake_cpu: Callable[..., None],
) -> None:
    # The machine: the CPU has fp16 instructions, PyTorch 2.1 no fp16 CPU matmul.
    fake_cpu(AMX_XEON, TORCH_2_1_KERNELS)
    why = capabilities("cpu").fp16.reason
    assert "has no float16 matmul on CPU" in why
    report = build_report("cpu")["capabilities"]
    assert report["fp16"] == {"supported": False, "reason": why, "missing_kernel": True}
    assert recommended("cpu").levers == {"amp": "bf16"}
    skips = {c.name: c.unavailable(CPU) for c in MATMUL_CONFIGS}
    assert skips["pure-fp16"] == f"fp16 does not run here: {why}"
    assert skips["pure-bf16"] is None and skips["amp-bf16"] is None
    _, skipped = candidates(CPU, {"amp": ["bf16", "fp16"]})
    (amp_fp16,) = skipped
    assert amp_fp16.levers == {"amp": "fp16"}
    assert amp_fp16.note.startswith("skipped (refused by this PyTorch)")


def test_a_first_question_asked_inside_torch_compile_gets_the_eager_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first capabilities() of a process may come from a compiled step (fast_math's plan):
    # the trial's thread runs outside the trace, and the answer is the one asked eagerly.
    eager = capabilities("cpu").to_dict()
    monkeypatch.setattr(hardware_cpu, "_cache", {})  # nothing found yet in this "process"
    speedflags._hardware._clear_cache()
    seen: dict[str, Any] = {}

    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        seen.update(capabilities("cpu").to_dict())
        return x * 2

    try:
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        speedflags._hardware._clear_cache()
    assert seen == eager
    # The bf16 kernels are tried only where the CPU has bf16 instructions (AVX512-BF16, AMX,
    # Arm BF16): a CPU without them (AVX2 Zen 3) answers "emulated" from its flags alone.
    tried = {"features", torch.bfloat16} if cpu_features().bf16_instructions() else {"features"}
    assert set(hardware_cpu._cache) >= tried
    assert (torch.bfloat16 in hardware_cpu._cache) == bool(cpu_features().bf16_instructions())
