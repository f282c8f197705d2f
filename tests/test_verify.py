"""speedflags.verify on a CPU: a verdict for every lever, each one measured, and its causes.

The verdicts depend on what this CPU offers (bf16 autocast is native with AVX512-BF16,
emulated without it; oneDNN's "medium" route needs bf16 support), so each test derives the
expected verdict from the lever's own capability check, and checks the measured figure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ZEN3, ZEN4, needs_cpu_autocast_fp16

import speedflags
from speedflags.__main__ import main
from speedflags._hardware import KernelTrial
from speedflags._measure import causes, probes
from speedflags._measure import route as route_module
from speedflags._measure import verdicts as check_module
from speedflags._measure.evidence import FP32_MAX, arithmetic
from speedflags._measure.lever_files import plain_value
from speedflags._measure.route import MediumRoute, effect_here, medium_route
from speedflags._measure.verdicts import judge
from speedflags._measure.verification import Verdict, Verification
from speedflags._measure.vocabulary import status_of
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers.autocast import cpu_autocast_takes_fp16
from speedflags.levers.registry import REGISTRY, lever_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def run() -> Verification:
    return speedflags.verify("cpu")


def _effective(name: str, value: object) -> bool:
    # the lever's own answer, with "medium" as tried on this CPU (verify's own reading)
    effect = effect_here(name, lever_spec(name).validate(value), CPU)
    return effect.effective and not effect.slow


def test_every_lever_value_of_the_registry_gets_a_verdict(run: Verification) -> None:
    labels = [v.label for v in run.verdicts]
    expected = ["baseline (every lever off)"] + [
        Verdict(spec.name, value, "").label
        for spec in REGISTRY
        for value in (plain_value(spec.name, spec.validate(c)) for c in spec.candidates)
    ]  # fmt: skip
    assert labels == expected
    assert run.restored and run.ok, str(run)
    # how long it took is recorded; never asserted (a busy machine takes longer: timing
    # belongs to benchmarks)
    assert run.elapsed_s is not None and run.elapsed_s > 0


def test_each_verdict_follows_the_capability_and_is_measured(run: Verification) -> None:
    for verdict in run.verdicts[1:]:
        effect = effect_here(verdict.lever, lever_spec(verdict.lever).validate(verdict.value), CPU)
        expected = {  # the capability's word, in the vocabulary every tool shares
            "in effect": "verified",
            "no effect here": "no effect here",
            "in effect, emulated: slower": "in effect, emulated: slower",
            "refused by this PyTorch": "refused by this PyTorch",
        }[status_of(effect)]
        assert verdict.status == expected, verdict
        if expected != "verified":
            assert verdict.reason, verdict  # the capability's reason
        if expected == "in effect, emulated: slower" and verdict.lever == "fp8":
            # torchao's emulation: float8 operands, an FP8-level error, a layer it converts
            assert verdict.measured["float8_operands"] and verdict.measured["arithmetic"] == "fp8"
            assert "(a 16x2048 by 2048x2048 matmul, 1 thread, 5 interleaved" in verdict.figure
        elif expected == "in effect, emulated: slower":  # in effect, and how much slower
            assert verdict.measured["dtype"] in ("bfloat16", "float16")
            assert "(a 256x256 matmul, 1 thread, 5 interleaved rounds)" in verdict.figure


@pytest.mark.parametrize(
    ("dtype", "word"),
    [(torch.bfloat16, "bf16"), pytest.param(torch.float16, "fp16", marks=needs_cpu_autocast_fp16)],
)
def test_emulated_autocast_is_in_effect_and_slower_never_no_effect(
    fake_cpu: Callable[..., None], dtype: torch.dtype, word: str
) -> None:
    # Failed before: verify said "no effect here" for bf16 autocast on an AVX2 CPU, whose
    # output was bfloat16 with bf16's error. The CPU is faked to lack the instructions (so
    # the branch runs on every CPU); the arithmetic is real (emulated where they are missing).
    fake_cpu(ZEN3)
    run = speedflags.verify("cpu", levers={"amp": [word]})
    verdict = run.verdict("amp")
    assert verdict.status == "in effect, emulated: slower"
    assert verdict.measured["dtype"] == str(dtype).replace("torch.", "")
    assert "emulated" in verdict.reason and verdict.measured["slower_factor"] > 0
    assert run.ok and "emulated, so slower than without it: amp=" in str(run)
    as_json = run.to_dict()["verdicts"][1]
    assert as_json["status"] == "in effect, emulated: slower" != "no effect here"
    # Failed before: the line printed "6.2x slower than without it" and then, from the CPU's
    # answer, "typically 40 to 1000 times slower than fp32" (bf16: "tens of times slower ...
    # 45x with 2 threads"), a figure measured elsewhere beside the one measured here.
    (line,) = [line for line in str(run).splitlines() if line.strip().startswith(f"amp='{word}'")]
    assert "times slower" not in line, line
    # one figure: the one measured here (on a CPU that has the instructions after all, the
    # emulated path is not slower, and says so with its figure)
    (figure,) = re.findall(r"\b(\d+(?:\.\d+)?)x\b", line)
    slower = verdict.measured["slower_factor"]
    measured = 1 / slower if "not slower here" in line else slower
    assert float(figure) == pytest.approx(measured, rel=0.06), line
    assert line.endswith(f"{word} on this CPU is emulated, slower than fp32"), line


def test_emulated_autocast_on_a_cpu_with_the_instructions_is_verified(
    fake_cpu: Callable[..., None],
) -> None:
    fake_cpu(ZEN4, {torch.bfloat16: KernelTrial("bfloat16")})  # AVX512-BF16, kernels run
    verdict = speedflags.verify("cpu", levers={"amp": ["bf16"]}).verdict("amp")
    assert verdict.status == "verified", verdict


def test_the_baseline_is_fp32(run: Verification) -> None:
    baseline = run.verdict("baseline")
    assert baseline.status == "verified"
    assert baseline.measured["matmul_error"] < FP32_MAX
    assert "(fp32)" in baseline.figure


@pytest.mark.parametrize(("amp", "dtype", "level"), [("bf16", "bfloat16", "bf16"),
                                                     ("fp16", "float16", "fp16")])  # fmt: skip
def test_autocast_is_measured_by_output_dtype_and_error(
    run: Verification, amp: str, dtype: str, level: str
) -> None:
    if amp == "fp16" and not cpu_autocast_takes_fp16():
        pytest.skip(f"PyTorch {torch.__version__}'s CPU autocast refuses fp16")
    verdict = run.verdict("amp", amp)
    # measured even where it is not native (emulated): the figure says what happened
    assert verdict.measured["dtype"] == dtype
    assert arithmetic(verdict.measured["matmul_error"], "fp16") == level
    assert f"output {dtype}" in verdict.figure


def test_sdpa_flash_is_verified_by_the_operator_that_ran(run: Verification) -> None:
    verdict = run.verdict("sdpa", ["flash"])
    if not speedflags.capabilities("cpu").flash_sdpa:
        assert verdict.status == "no effect here"
        return
    assert verdict.status == "verified"
    assert verdict.measured["ran"] == "flash"
    # the CPU operator's name: _scaled_dot_product_flash_attention_for_cpu from PyTorch 2.2
    assert "_scaled_dot_product_flash_attention" in verdict.figure
    for other in ("efficient", "cudnn"):  # CUDA kernels: the math fallback ran instead
        assert run.verdict("sdpa", [other]).measured["ran"] == "math"


def test_matmul_precision_on_a_cpu_is_judged_by_the_onednn_route(run: Verification) -> None:
    high = run.verdict("matmul_precision", "high")
    assert high.status == "no effect here"
    assert high.measured["bit_identical_to_highest"] is True  # 'high' is TF32: not on a CPU
    medium = run.verdict("matmul_precision", "medium")
    route = medium_route()  # found once by trying; each branch asserted where it holds
    if route.bf16:  # oneDNN's bf16 fpmath (AMX Xeons): bf16-level error
        assert medium.status == "verified" and medium.measured["arithmetic"] == "bf16"
        assert "computes in bf16" in medium.reason
    elif route.effective:  # oneDNN's kernel in fp32 (AMD Zen): another kernel's bits
        assert medium.status == "verified" and medium.measured["arithmetic"] == "fp32"
        assert medium.measured["bit_identical_to_highest"] is False
        assert "keeps fp32 arithmetic" in medium.reason
    else:  # no oneDNN route (no AVX-512, or a PyTorch without it): nothing changes
        assert medium.status == "no effect here"
        assert medium.measured.get("bit_identical_to_highest", True) is True
        assert medium.reason == f"no effect on cpu: {route.reason}"


@pytest.mark.parametrize(
    ("arithmetic", "status", "said"),
    [
        ("bf16", "verified", "computes in bf16"),
        ("fp32", "verified", "keeps fp32 arithmetic"),
        ("none", "no effect here", "no oneDNN route"),
    ],
)
def test_the_medium_verdict_follows_the_route_found(
    monkeypatch: pytest.MonkeyPatch, arithmetic: str, status: str, said: str
) -> None:
    # The routes of the other CPUs and PyTorch versions cannot be had here: the answer is
    # faked (route._cache, where medium_route keeps it), and so are the measurement the probe
    # would give there and, for an AVX2 CPU, PyTorch's oneDNN check; what is checked is how
    # verify words and judges each.
    from speedflags.levers import precision

    monkeypatch.setattr(precision, "_onednn_bf16", lambda: True)
    faked = MediumRoute(arithmetic, f"faked for a test: {said}")
    monkeypatch.setitem(route_module._cache, "cpu", faked)
    observed = {
        "bf16": probes.Observation(True, "matmul error 2.5e-03 (bf16 arithmetic)",
                                   {"arithmetic": "bf16", "bit_identical_to_highest": False}),
        "fp32": probes.Observation(True, "another kernel ran",
                                   {"arithmetic": "fp32", "bit_identical_to_highest": False}),
        "none": probes.Observation(False, "the same kernel ran",
                                   {"arithmetic": "fp32", "bit_identical_to_highest": True}),
    }[arithmetic]  # fmt: skip
    monkeypatch.setitem(probes.PROBES, "matmul_precision", lambda ctx, value: observed)
    verdict = speedflags.verify("cpu", levers={"matmul_precision": ["medium"]}).verdict(
        "matmul_precision"
    )
    assert verdict.status == status
    assert f"faked for a test: {said}" in verdict.reason


def test_a_kernel_that_refuses_the_inputs_is_not_in_effect_with_pytorchs_reason() -> None:
    # A real refusal: the CPU flash kernel takes no dropout, so the math fallback runs.
    if not hasattr(torch.nn, "attention"):
        pytest.skip(f"PyTorch {torch.__version__} cannot ask one SDPA kernel alone (2.3+)")
    ctx = probes.Context(CPU)
    probes.baseline(ctx)
    q, k, v = torch.randn(3, 1, 2, 16, 8)
    obs = probes.sdpa(ctx, ("flash",), [q, k, v], dropout_p=0.5)
    verdict = judge("sdpa", ("flash",), "", obs, CPU)
    assert verdict.status == "requested but not in effect"
    assert verdict.measured["ran"] == "math"
    assert "dropout" in verdict.reason and "Triggered internally" not in verdict.reason
    assert not Verification("cpu", [verdict]).ok


def test_a_permission_the_library_did_not_take_is_no_effect_not_a_failure() -> None:
    # The observation an H200 gave (PyTorch 2.11): the flags allowed reduced-precision
    # reductions, cuBLAS kept fp32 ones, the results were bit-identical.
    figure = "64x65536 @ 65536x64: fp16 error 2.1e-04 (fp32 reductions: 2.1e-04, bit-identical)"
    why = "a permission cuBLAS did not take"
    taken = probes.Observation(False, figure, unused=why)
    verdict = judge("reduced_precision_reduction", True, "", taken, torch.device("cuda"))
    assert (verdict.status, verdict.reason, verdict.figure) == ("no effect here", why, figure)
    assert Verification("cuda:0", [verdict]).ok
    # without that reason (the flags did not read as asked), the same figure is a failure
    refused = probes.Observation(False, figure)
    verdict = judge("reduced_precision_reduction", True, "", refused, torch.device("cuda"))
    assert verdict.status == "requested but not in effect"
    assert not Verification("cuda:0", [verdict]).ok


def test_a_probe_that_raises_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: probes.Context, value: object) -> None:
        raise RuntimeError("no such kernel\ndetails")

    monkeypatch.setitem(probes.PROBES, "sdpa", broken)
    run = speedflags.verify("cpu", levers={"sdpa": ["flash"]})
    verdict = run.verdict("sdpa")
    expected = "could not be measured" if _effective("sdpa", "flash") else "no effect here"
    assert verdict.status == expected
    if expected == "could not be measured":
        assert verdict.reason == "the probe raised RuntimeError: no such kernel"
        assert not run.ok


def test_causes_name_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    obs = probes.Observation(False, "matmul error 2.4e-07 (fp32)", inside={"cudnn_enabled": True})
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    assert "NVIDIA_TF32_OVERRIDE=0 is set" in causes.find("tf32", True, obs, cuda)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    assert causes.find("tf32", True, obs, cuda).startswith("no cause found")
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in causes.find("baseline", False, obs, cuda)
    conflict = {"tf32_consistent": False, "tf32_conflicts": ["a disagrees with b"]}
    mixed = probes.Observation(False, "", inside=conflict)
    assert "mixed TF32 state inside the block: a disagrees with b" in causes.find(
        "tf32", True, mixed, cuda
    )
    off = probes.Observation(False, "", inside={"cudnn_enabled": False, "mkldnn_enabled": False})
    assert "cuDNN is disabled" in causes.find("cudnn_benchmark", True, off, cuda)
    assert "oneDNN is disabled" in causes.find("matmul_precision", "medium", off, CPU)


def test_tf32_override_blocks_only_an_ampere_gpu(
    monkeypatch: pytest.MonkeyPatch, fake_gpu: Callable[..., None]
) -> None:
    # A CPU build cannot show a GPU: its compute capability is faked.
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    fake_gpu((8, 0))
    cuda = torch.device("cuda", 0)
    assert not speedflags.capabilities(cuda).tf32  # the capability says no...
    assert "NVIDIA_TF32_OVERRIDE=0" in (causes.environment_block("tf32", cuda) or "")
    assert causes.environment_block("amp", cuda) is None  # ...verify measures and blames it
    fake_gpu((7, 5), "Tesla T4")
    assert causes.environment_block("tf32", cuda) is None  # no TF32 hardware at all


def test_bad_arguments_name_the_argument_the_value_and_the_choices() -> None:
    with pytest.raises(InvalidValueError, match=r"verify\(levers=\.\.\.\): unknown lever 'tf33'"):
        speedflags.verify("cpu", levers=["tf33"])
    with pytest.raises(InvalidValueError, match=r"levers\['amp'\]='bf17'.*valid"):
        speedflags.verify("cpu", levers={"amp": ["bf17"]})
    with pytest.raises(InvalidTypeError, match=r"verify\(levers=3\)"):
        speedflags.verify("cpu", levers=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match=r"verify\(device='gpu'\)"):
        speedflags.verify("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidValueError, match="CUDA is not available"):
            speedflags.verify("cuda")


def test_the_command_line_prints_saves_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sub" / "verify.json"
    assert main(["verify", "--device", "cpu", "--levers", "tf32,amp", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speedflags verify on cpu" in printed and "tf32=True" in printed
    data = json.loads(out.read_text())
    assert data["format"] == "speedflags-verify/1" and data["ok"] is True
    assert [v["label"] for v in data["verdicts"]][:2] == ["baseline (every lever off)", "tf32=True"]
    assert main(["verify", "--device", "cpu", "--levers", "bogus"]) == 2
    assert "unknown lever 'bogus'" in capsys.readouterr().err
    assert main(["verify", "--device", "cpu", "--json", str(tmp_path)]) == 2  # a folder
    assert "a folder, not a file" in capsys.readouterr().err


def test_a_failed_verdict_gives_exit_status_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = Verification("cpu", [Verdict("amp", "bf16", "requested but not in effect",
                                          "output float32", "autocast is off")])  # fmt: skip
    monkeypatch.setattr(check_module, "verify", lambda *args: failed)
    assert main(["verify", "--device", "cpu"]) == 1
    assert "NOT VERIFIED: amp='bf16'" in capsys.readouterr().out


def test_bench_and_tune_results_record_the_verdicts() -> None:
    from speedflags.bench.runner import Settings
    from speedflags.bench.runner import run as bench

    settings = Settings(CPU, ("sdpa",), sizes=(16,), passes=1, min_rounds=1, min_time_s=0,
                        warmup_rounds=1, warmup_s=0)  # fmt: skip
    recorded = bench(settings).environment["verdicts"]
    assert set(recorded) == {"baseline (every lever off)", "sdpa=['math']", "sdpa=['flash']",
                             "sdpa=['efficient']", "sdpa=['cudnn']"}  # fmt: skip
    q = torch.randn(1, 2, 16, 8)
    result = speedflags.tune(torch.nn.functional.scaled_dot_product_attention, q, q, q,
                             levers=["sdpa"], budget=1e-2, seconds=10)  # fmt: skip
    timed = [r for r in result.rows if r.speedup is not None]
    assert {r.label for r in timed} <= set(result.verdicts) | {"(fp32)"}
    assert result.to_dict()["tune"]["verdicts"] == result.verdicts


def test_a_flag_left_changed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # A probe that leaves cudnn.benchmark on (injected: every real probe restores what it
    # sets): the run says which setting reads differently, not only that one does.
    from speedflags._measure import probes

    def leaky(ctx: Any, value: Any) -> Any:
        torch.backends.cudnn.benchmark = True
        return probes.amp(ctx, None)

    monkeypatch.setitem(probes.PROBES, "amp", leaky)
    try:
        run = speedflags.verify("cpu", levers={"amp": [False]})
    finally:
        torch.backends.cudnn.benchmark = False
    assert not run.restored and run.unrestored == ("cudnn_benchmark",)
    assert "FLAGS NOT RESTORED: cudnn_benchmark read differently than before" in str(run)
    assert run.to_dict()["unrestored"] == ["cudnn_benchmark"]


def test_a_lever_verify_cannot_measure_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # deterministic has no probe: levers=["deterministic"] verified only the baseline and said
    # ok, exit 0; the dict form gave an "could not be measured" verdict. Both are refused now,
    # before the baseline runs, naming the lever and the levers verify measures.
    assert "deterministic" not in probes.PROBES
    ran: list[str] = []
    monkeypatch.setattr(probes, "baseline", lambda ctx: ran.append("baseline"))
    measured = ", ".join(check_module.verifiable_levers())
    for levers in (["deterministic"], "deterministic", {"deterministic": [True]}):
        with pytest.raises(InvalidValueError) as refused:
            speedflags.verify("cpu", levers=levers)  # type: ignore[arg-type]
        assert str(refused.value) == (
            "verify(levers=...): 'deterministic' cannot be verified: no probe measures whether "
            f"it took effect; valid: {measured}"
        )
    assert ran == []
    assert main(["verify", "--device", "cpu", "--levers", "deterministic"]) == 2
    err = capsys.readouterr().err
    assert "--levers 'deterministic': deterministic cannot be verified" in err
    assert "valid: amp, cudnn_benchmark, fp8, matmul_precision" in err and ran == []


def test_a_verdict_the_run_does_not_have_is_a_clear_error() -> None:
    run = Verification(
        "cpu", [Verdict("baseline", False, "verified"), Verdict("tf32", True, "verified")]
    )
    expected = (
        r"verdict\('deterministic'\): this run has no verdict for it; it has: "
        r"baseline \(every lever off\), tf32=True"
    )
    with pytest.raises(InvalidValueError, match=expected) as missing:
        run.verdict("deterministic")
    assert isinstance(missing.value, KeyError)  # what it raised before, bare
    with pytest.raises(KeyError, match=r"verdict\(tf32=False\): this run has no verdict"):
        run.verdict("tf32", False)
