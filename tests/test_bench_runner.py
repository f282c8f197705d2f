"""speedflags.bench.runner: interleaved passes, progress, and a clean stop on Ctrl-C.

Tiny sizes and one or two rounds: these check the loop's logic, never its speed.
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
from speedflags._measure.configs import Config
from speedflags._measure.rounds import measure_rounds
from speedflags._measure.workloads import WORKLOADS, MatmulProblem, Runner, _gib, memory_bytes
from speedflags.bench import runner as runner_module
from speedflags.bench.runner import Progress, Settings, run

CPU = torch.device("cpu")


def tiny(**overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        device=CPU,
        workloads=("matmul",),
        sizes=(32,),
        passes=2,
        min_rounds=2,
        min_time_s=0.0,
        warmup_rounds=1,
        warmup_s=0.0,
    )
    values.update(overrides)
    return Settings(**values)


def measured(bench_run: Any) -> list[str]:
    return [r.config for r in bench_run.results if not r.skipped]


# This CPU, and the CPUs CI runs on faked (conftest's fake_cpu): an AMX Xeon with this
# PyTorch's real kernels (fp16 measured where they run, emulated where this CPU lacks the
# instructions) and with PyTorch 2.1.2's (fp16 instructions, no fp16 CPU matmul: skipped),
# an AVX2 Zen 3.
CPU_KINDS = {
    "this-cpu": None,
    "amx-xeon": (AMX_XEON,),
    "amx-xeon-torch-2.1": (AMX_XEON, TORCH_2_1_KERNELS),
    "zen3": (ZEN3, {}, None, False),  # AVX2: PyTorch's oneDNN bf16 check says no too
}


@pytest.mark.parametrize("kind", list(CPU_KINDS))
def test_every_runnable_configuration_is_measured_in_every_pass(
    fake_cpu: Callable[..., None], kind: str
) -> None:
    if CPU_KINDS[kind] is not None:
        fake_cpu(*CPU_KINDS[kind])
    events: list[Progress] = []
    result = run(tiny(), events.append)
    assert not result.interrupted and result.flags_restored
    group = [r for r in result.results if r.group == "matmul cpu 32"]
    once = [r for r in result.results if r.group == "matmul cpu 32 (emulated)"]
    assert len(group) + len(once) == len(result.results)
    configs = [r.config for r in group if not r.skipped]
    assert configs[0] == "fp32"
    runnable = [c.name for c in WORKLOADS["matmul"].configs if c.unavailable(CPU) is None]
    assert configs == runnable  # the capability answer decides, and nothing raised
    assert "tf32" not in configs  # no TF32 on any CPU
    skipped = {r.config: r.skipped for r in group if r.skipped}
    if kind == "amx-xeon-torch-2.1":  # the machine: the fp16 rows skipped, with why
        assert "has no float16 matmul on CPU" in str(skipped["pure-fp16"])
        assert "pure-bf16" in configs and "amp-bf16" in configs
    if kind == "amx-xeon" and cpu_kernels(torch.float16).runs:  # a recent PyTorch
        assert "pure-fp16" in configs
        assert ("amp-fp16" in configs) is CPU_AUTOCAST_FP16
    # an emulated configuration (bf16 or fp16 without the instructions) is measured once, in
    # a group of its own beside the baseline, marked; its row in the group says where
    emulated = [c.name for c in WORKLOADS["matmul"].configs if c.emulated(CPU)]
    if kind == "zen3":  # AVX2: the bf16 configurations run emulated, and fp16 where it runs
        assert {"amp-bf16", "pure-bf16"} <= set(emulated)
        assert ("pure-fp16" in emulated) is cpu_kernels(torch.float16).runs  # not on 2.1
    assert [r.config for r in once] == (["fp32", *emulated] if emulated else [])
    for name in emulated:
        assert skipped[name].startswith("in effect, emulated: slower: ")
        assert skipped[name].endswith("; measured once, at size 32 (the group below)")
    for row in once:
        assert len(row.pass_medians_s) == 1 and row.rounds == 2  # once: 1 pass, 2 rounds
        assert row.verdict == ("" if row.baseline else "in effect, emulated: slower")
        assert row.speedup is not None and row.median_s is not None and row.median_s > 0
        assert row.noise == (0.0 if row.baseline else None)  # once: no noise estimate
    for row in group:
        if row.skipped:
            assert row.median_s is None and row.skipped
            continue
        assert len(row.pass_medians_s) == 2
        assert row.rounds == 4  # 2 rounds x 2 passes
        assert row.median_s is not None and row.median_s > 0
        assert row.rel_error is not None and row.flops == 2 * 32**3
        assert row.levers and not row.verdict
        assert row.speedup is not None and row.pct_of_fastest is not None
    done = [e for e in events if e.kind == "done"]
    # interleaved: fp32, medium, ... then again fp32, medium, ...; then the emulated, once
    assert [e.config for e in done] == configs + configs + [r.config for r in once]
    assert [e.step for e in done] == list(range(1, len(done) + 1))
    assert done[-1].step == done[-1].steps
    assert all(e.median_s for e in done)


def test_results_keep_configuration_order_with_skips_in_place() -> None:
    result = run(tiny(passes=1))
    names = [r.config for r in result.results if r.group == "matmul cpu 32"]
    assert names == [
        "fp32",
        "tf32",
        "precision-high",
        "precision-medium",
        "amp-bf16",
        "amp-fp16",
        "pure-bf16",
        "pure-fp16",
    ]


def test_a_workload_the_device_lacks_is_one_skipped_row() -> None:
    result = run(tiny(workloads=("conv",)))
    (row,) = result.results
    assert row.config == "(all)" and row.skipped and "cuda only" in row.skipped


def test_plan_uses_each_workloads_default_sizes_unless_told() -> None:
    plan = Settings(CPU, ("matmul", "conv")).plan()
    assert [(w.name, s) for w, s in plan] == [("matmul", 1024), ("matmul", 2048), ("conv", None)]
    plan = Settings(CPU, ("sdpa",), sizes=(7, 9)).plan()
    assert [(w.name, s) for w, s in plan] == [("sdpa", 7), ("sdpa", 9)]


def test_plan_for_a_gpu_uses_the_gpu_sizes(fake_gpu: Callable[..., None]) -> None:
    fake_gpu((9, 0), name="NVIDIA H100 80GB HBM3")
    plan = Settings(torch.device("cuda"), ("matmul", "conv")).plan()
    assert [(w.name, s) for w, s in plan] == [
        ("matmul", 4096),
        ("matmul", 8192),
        ("conv", 56),
        ("conv", 112),
    ]


@pytest.mark.usefixtures("cpu_with_bf16")  # three measurable matmul configurations
def test_ctrl_c_between_measurements_keeps_the_results_so_far() -> None:
    before = speedflags.snapshot()
    done: list[str] = []

    def progress(event: Progress) -> None:  # Ctrl-C after the third measurement
        if event.kind == "done":
            done.append(event.config)
            if len(done) == 3:
                raise KeyboardInterrupt

    result = run(tiny(workloads=("matmul", "sdpa")), progress)
    assert result.interrupted
    assert result.flags_restored and speedflags.snapshot() == before
    assert not speedflags.ledger().open_frames()
    assert measured(result) == done
    assert all(len(r.pass_medians_s) == 1 for r in result.results if not r.skipped)
    assert not any(r.workload == "sdpa" for r in result.results)  # never reached
    fp32 = result.results[0]
    assert fp32.speedup == 1.0  # the table still works on partial results


@pytest.mark.usefixtures("cpu_with_bf16")  # amp-bf16 measured: faked where this CPU lacks bf16
def test_ctrl_c_inside_a_frame_restores_every_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    before = speedflags.snapshot()
    inside: list[bool] = []
    real = runner_module.measure_rounds

    def interrupted(runner: Any, clock: Any, rounds: int, calls: int) -> list[float]:
        if autocast_enabled("cpu"):  # the amp-bf16 frame is open
            inside.append(torch.get_float32_matmul_precision() == "highest")
            raise KeyboardInterrupt
        return real(runner, clock, rounds, calls)

    monkeypatch.setattr(runner_module, "measure_rounds", interrupted)
    result = run(tiny())
    assert inside == [True]
    assert result.interrupted and result.flags_restored
    assert speedflags.snapshot() == before
    assert not speedflags.ledger().open_frames()
    assert measured(result) == ["fp32", "precision-medium"]


def test_a_round_of_several_calls_uses_a_new_input_set_per_call() -> None:
    sets = [(torch.tensor(float(i)),) for i in range(5)]
    ran: list[float] = []
    ticks = iter(range(0, 1000, 10))  # a clock that advances 10 per reading
    runner = Runner(sets, lambda x: ran.append(float(x)))
    times = measure_rounds(runner, lambda: float(next(ticks)), rounds=2, calls=3)
    assert ran == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]  # rotating through the sets
    assert times == [10 / 3, 10 / 3]  # per call: one clock interval shared by three calls


def test_settings_record_the_device_as_text() -> None:
    assert tiny().to_dict()["device"] == "cpu"
    assert tiny().to_dict()["passes"] == 2


def test_a_configuration_pytorch_refuses_on_its_first_call_is_skipped_with_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stands for a dtype kernel the capabilities did not foresee: PyTorch raises on the first
    # call (as PyTorch 2.1 does for a float16 CPU matmul). The run goes on without it.
    real = MatmulProblem.runner
    # (each sets a lever, so that neither is identical to the baseline: those are not timed)
    configs = (
        Config("fp32", baseline=True),
        Config("refused", {"sdpa": "math"}),
        Config("after", {"sdpa": "flash"}),
    )

    def refusing(self: MatmulProblem, config: Any) -> Runner:
        if config.name != "refused":
            return real(self, config)

        def refuse(*inputs: torch.Tensor) -> None:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\ndetails")

        return Runner([(torch.ones(2),)], refuse)

    monkeypatch.setattr(MatmulProblem, "runner", refusing)
    events: list[Progress] = []
    before = speedflags.snapshot()
    result = run(tiny(configs=configs), events.append)
    assert not result.interrupted and result.flags_restored and speedflags.snapshot() == before
    rows = {r.config: r for r in result.results}
    assert list(rows) == ["fp32", "refused", "after"]  # in place, in order
    assert rows["refused"].skipped == (
        f"PyTorch {torch.__version__} refused it here: RuntimeError: "
        "\"addmm_impl_cpu_\" not implemented for 'Half'"
    )
    done = [e for e in events if e.kind == "done"]
    assert [e.config for e in done] == ["fp32", "after", "fp32", "after"]
    assert [e.step for e in done] == list(range(1, len(done) + 1))
    assert done[-1].step == done[-1].steps  # the refused configuration left the count


def test_a_configuration_that_raises_after_running_ends_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = MatmulProblem.runner
    calls: list[int] = []

    def failing_later(self: MatmulProblem, config: Any) -> Runner:
        inner = real(self, config)
        if config.name != "fp32":
            return inner

        def call(*inputs: torch.Tensor) -> Any:
            calls.append(1)
            if len(calls) > 20:  # well into the second pass
                raise RuntimeError("a real failure")
            return inner.run(*inputs)

        return Runner([inner.setup()], call, inner.output)

    monkeypatch.setattr(MatmulProblem, "runner", failing_later)
    with pytest.raises(RuntimeError, match="a real failure"):
        run(tiny(min_rounds=10))


def test_a_configuration_identical_to_the_baseline_is_not_timed_against_it() -> None:
    # Failed before: the same configuration twice was timed and credited with a speedup
    # (the examples printed +23 % and -57 % for it). Now the row says so, with no figure.
    configs = (
        Config("fp32", baseline=True),
        Config("fp32-again", {"tf32": False, "amp": False}),
        Config("nothing"),
    )
    result = run(tiny(configs=configs))
    rows = {r.config: r for r in result.results}
    for name in ("fp32-again", "nothing"):
        assert rows[name].skipped == "identical to the baseline: nothing to compare it with"
        assert rows[name].speedup is None and rows[name].median_s is None


def test_an_emulated_configuration_is_measured_once_however_many_sizes(
    fake_cpu: Callable[..., None],
) -> None:
    # Failed before: with two sizes, the emulated group measured and listed amp-fp16 and
    # pure-fp16 twice each, and marked their rows "*" (a lever with no effect here) though
    # they are in effect, emulated. The CPU is faked to lack bf16 and fp16 instructions
    # (AVX2); the arithmetic is real.
    fake_cpu(ZEN3)
    result = run(tiny(sizes=(32, 48), passes=1))
    once = [r for r in result.results if r.group.endswith("(emulated)")]
    emulated = [c.name for c in WORKLOADS["matmul"].configs if c.emulated(CPU)]
    assert emulated and [r.config for r in once] == ["fp32", *emulated]
    assert once[0].group == "matmul cpu 32 (emulated)"  # at the smaller size
    assert all(r.notes == () for r in once), [(r.config, r.notes) for r in once]


@pytest.mark.usefixtures("cpu_with_bf16")  # faked where this CPU has no bf16 instructions
def test_a_configuration_that_does_what_another_does_here_is_no_claim_of_its_own() -> None:
    # Failed before: on a CPU, where TF32 does nothing, mlp-train timed tf32+amp-bf16 beside
    # amp-bf16 and printed it faster (held around the loop against entered per step: the
    # difference was the way autocast was entered, credited to TF32). Now both are entered
    # per step, and on a CPU the one is the other: skipped, saying so.
    result = run(tiny(workloads=("mlp-train",), passes=1))
    rows = {r.config: r for r in result.results}
    skipped = rows["tf32+amp-bf16"].skipped
    assert skipped is not None and skipped.startswith("the same as amp-bf16 on cpu: tf32: ")
    assert "no effect on cpu" in skipped and rows["tf32+amp-bf16"].median_s is None
    assert rows["amp-bf16"].median_s is not None  # measured, once
    assert "the same as" not in str(rows["param-bf16+amp-bf16"].skipped)


def test_on_an_ampere_gpu_tf32_with_autocast_is_a_claim_of_its_own(
    fake_gpu: Callable[..., None],
) -> None:
    fake_gpu((8, 0))  # the capability answers only: nothing runs on it here
    mlp = WORKLOADS["mlp-train"]
    cuda = torch.device("cuda")
    assert mlp.same_as_another(mlp.config("tf32+amp-bf16"), cuda) is None
    both, amp = mlp.config("tf32+amp-bf16"), mlp.config("amp-bf16")
    assert both.in_effect(cuda) != amp.in_effect(cuda)
    assert both.in_effect(CPU) == amp.in_effect(CPU)  # what TF32 adds on a CPU: nothing


def test_a_size_one_workload_cannot_take_skips_it_and_the_rest_runs() -> None:
    # Failed before (from the command line: the whole run refused): the smallest size the
    # convnet's estimate does not fit in this machine's memory, which the matmul takes.
    have = memory_bytes(CPU)
    if have is None:
        pytest.skip("this system does not say how much memory it has")
    convnet = WORKLOADS["convnet-train"]
    size = 1
    while convnet.memory(size, "cpu") <= have:
        size *= 2
    assert WORKLOADS["matmul"].memory(size, "cpu") < have / 4, "no size tells them apart here"
    result = run(tiny(workloads=("convnet-train", "matmul"), sizes=(size,), passes=1))
    (skipped,) = [r for r in result.results if r.workload == "convnet-train"]
    assert skipped.config == "(all)" and skipped.size == size
    assert str(skipped.skipped).startswith(f"convnet-train at size {size} needs at least ")
    assert str(skipped.skipped).endswith(" (estimated); cpu has " + _gib(have))
    assert f"matmul cpu {size}" in {r.group for r in result.results if not r.skipped}
