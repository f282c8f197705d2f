"""speedflags._measure.workloads and .accuracy: inputs, FLOP counts, float64 references, errors.

Everything runs on the CPU at tiny sizes with the real torch kernels; the error bands are the
ones ``benchmarks/RESULTS.md`` measured (fp32 ~2.5e-7, bf16 ~3e-3; see docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from speedflags._measure.accuracy import TOLERANCE, coarsest, relative_error
from speedflags._measure.configs import Config
from speedflags._measure.problems import _kernel_refuses
from speedflags._measure.timing import cache_bytes, rotation_sets
from speedflags._measure.workloads import (
    WORKLOADS,
    ConvProblem,
    MatmulProblem,
    MlpTrainProblem,
    SdpaProblem,
)

CPU = torch.device("cpu")
FP32 = Config("fp32", baseline=True)
AMP = Config("amp-bf16", {"amp": "bf16"})
# bf16 accuracy is the same emulated or native: a CPU without bf16 instructions is faked to
# have them (conftest's cpu_with_bf16), so these run on every machine
needs_cpu_bf16 = pytest.mark.usefixtures("cpu_with_bf16")


def error_of(problem: object, config: Config) -> float:
    runner = problem.runner(config)  # type: ignore[attr-defined]
    with config.frames(CPU):
        return float(problem.error(runner))  # type: ignore[attr-defined]


def trains(runner: Any, steps: int) -> bool:
    """Whether ``steps`` fp32 steps of a train-step runner on one batch lower its loss."""
    x, y = runner.setup()
    with FP32.frames(CPU):
        first = float(runner.run(x, y))
        for _ in range(steps):
            last = float(runner.run(x, y))
    return last < first


def test_inputs_are_reproducible_random_normals_and_leave_the_global_rng_alone() -> None:
    rng = torch.random.get_rng_state()
    a = MatmulProblem(48, CPU)
    b = MatmulProblem(48, CPU)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.equal(a._sets[0][0], b._sets[0][0])
    x = a._sets[0][0]
    assert not torch.equal(x, a._sets[0][1])  # two different operands
    assert not torch.equal(x, a._sets[1][0])  # and different sets
    assert 0.8 < float(x.std()) < 1.2 and abs(float(x.mean())) < 0.1  # randn, never zeros


def test_matmul_rotates_input_sets_past_the_cache() -> None:
    problem = MatmulProblem(48, CPU)
    assert problem.sets == rotation_sets(2 * 48 * 48 * 4, cache_bytes(CPU))
    assert problem.sets > 1
    runner = problem.runner(FP32)
    seen = [runner.setup()[0].data_ptr() for _ in range(problem.sets + 1)]
    assert len(set(seen)) == problem.sets
    assert seen[0] == seen[-1]  # back to the first set after a full cycle


def test_matmul_flops_reference_and_errors() -> None:
    problem = MatmulProblem(64, CPU)
    assert problem.flops == 2 * 64**3
    a, b = problem._sets[0]
    assert torch.allclose(problem.reference(), a.double() @ b.double())
    assert problem.reference().dtype == torch.float64
    assert error_of(problem, FP32) < 1e-6


@needs_cpu_bf16
def test_bf16_costs_bf16_level_accuracy() -> None:
    problem = MatmulProblem(64, CPU)
    amp = error_of(problem, AMP)
    pure = error_of(problem, Config("pure-bf16", dtype=torch.bfloat16))
    assert 3e-4 < amp < TOLERANCE["bf16"]
    assert 3e-4 < pure < TOLERANCE["bf16"]
    assert problem.runner(Config("pure-bf16", dtype=torch.bfloat16)).setup()[0].dtype == (
        torch.bfloat16
    )


def test_the_reference_is_computed_without_autocast() -> None:
    problem = MatmulProblem(32, CPU)
    with AMP.frames(CPU):
        ref = problem.reference()  # first computed inside an autocast block
    a, b = problem._sets[0]
    assert torch.equal(ref, a.double() @ b.double())


def test_mlp_train_step_shape_flops_and_a_real_step() -> None:
    problem = MlpTrainProblem(32, CPU)
    assert problem.batch == 32
    assert problem.flops == 8 * 2 * 32 * 32 * 32
    assert "Linear(32, 32) x3" in problem.shape
    assert trains(problem.runner(FP32), 20)  # AdamW really trains


def test_mlp_train_error_is_the_first_gradient_against_float64() -> None:
    problem = MlpTrainProblem(32, CPU)
    assert problem.error_of == "first-layer weight gradient"
    assert problem.reference().shape == (32, 32)
    assert problem.reference().dtype == torch.float64
    assert error_of(problem, FP32) < 1e-5
    # the runner's training does not change what the error is measured on
    runner = problem.runner(FP32)
    with FP32.frames(CPU):
        runner.run(*runner.setup())
        assert problem.error(runner) < 1e-5


@needs_cpu_bf16
def test_mlp_train_bf16_autocast_error_band() -> None:
    problem = MlpTrainProblem(64, CPU)
    config = WORKLOADS["mlp-train"].config("tf32+amp-bf16")
    assert 5e-4 < error_of(problem, config) < TOLERANCE["bf16"]


def test_mlp_batch_is_capped_at_512() -> None:
    assert MlpTrainProblem(600, CPU).batch == 512


def test_sdpa_problem_reference_and_backends() -> None:
    problem = SdpaProblem(64, CPU)
    assert problem.flops == 4 * 2 * 8 * 64 * 64 * 64
    assert problem.input_precision == "fp32"
    workload = WORKLOADS["sdpa"]
    assert error_of(problem, workload.config("math")) < 1e-5
    assert problem.skip_reason(workload.config("flash")) is None
    assert error_of(problem, workload.config("flash")) < 1e-5
    assert "cannot run on cpu" in str(problem.skip_reason(workload.config("efficient")))


def test_a_kernel_that_refuses_the_inputs_is_named_not_silently_replaced() -> None:
    problem = SdpaProblem(32, CPU)
    reason = _kernel_refuses("efficient", problem._sets[0])
    assert reason is not None and reason.startswith("the 'efficient' SDPA kernel refuses")
    assert _kernel_refuses("flash", problem._sets[0]) is None
    assert _kernel_refuses("math", problem._sets[0]) is None


def test_conv_problem_runs_on_cpu_but_the_workload_is_cuda_only() -> None:
    problem = ConvProblem(8, CPU)
    assert problem.flops == 2 * 8 * 64 * 8 * 8 * 64 * 9
    assert error_of(problem, FP32) < 1e-5
    reason = WORKLOADS["conv"].unavailable(CPU)
    assert reason is not None and "cuda only" in reason


def test_cuda_workloads_run_on_a_gpu_and_say_why_without_one() -> None:
    reason = WORKLOADS["matmul"].unavailable(torch.device("cuda"))
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert reason is not None and "CUDA is not available" in reason


def test_unknown_configuration_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="matmul has no configuration 'tf64'"):
        WORKLOADS["matmul"].config("tf64")


def test_relative_error_and_tolerances() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert relative_error(torch.ones(2), torch.zeros(2, dtype=torch.float64)) == pytest.approx(
        2**0.5
    )
    assert coarsest("fp32", "tf32") == "tf32"
    assert coarsest("bf16", "fp16") == "bf16"
    assert TOLERANCE["fp32"] < TOLERANCE["tf32"] <= TOLERANCE["fp16"] < TOLERANCE["bf16"]


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    # What a TF32 tensor core does to float32 inputs: round to nearest even at 10 mantissa
    # bits (emulated: this CPU has no TF32 kernel).
    bits = x.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)


def test_tolerances_tell_fp32_from_tf32_and_bf16() -> None:
    # accuracy.py's claim: the fp32 bound lies below a TF32 (or bf16) run's error, and each
    # bound lies well above the error its own arithmetic makes.
    problem = MatmulProblem(256, CPU)
    a, b = problem._sets[0]
    ref = problem.reference()
    fp32 = relative_error(a @ b, ref)
    tf32 = relative_error(_round_to_tf32(a) @ _round_to_tf32(b), ref)
    bf16 = relative_error(a.bfloat16() @ b.bfloat16(), ref)
    assert 1e-4 < tf32 < 1e-3  # the known TF32 level, ~3e-4
    assert fp32 * 100 < TOLERANCE["fp32"] < tf32 < bf16
    assert tf32 * 10 < TOLERANCE["tf32"] and tf32 * 10 < TOLERANCE["fp16"]
    assert bf16 * 5 < TOLERANCE["bf16"]


@needs_cpu_bf16
def test_mlp_train_in_pure_bf16_runs_and_measures_its_error_on_every_pytorch() -> None:
    # bf16 weights and inputs; the loss in float32, as the timed step computes it (PyTorch 2.1
    # has no bfloat16 mse_loss on a CPU, and the error is that of the step that is timed)
    problem = MlpTrainProblem(32, CPU)
    pure = Config("pure-bf16", dtype=torch.bfloat16)
    assert 5e-4 < error_of(problem, pure) < TOLERANCE["bf16"]
    runner = problem.runner(pure)
    with pure.frames(CPU):
        assert runner.run(*runner.setup()).dtype == torch.float32


def test_transformer_train_step_shape_flops_reference_and_a_real_step() -> None:
    from speedflags._measure.model_problems import TransformerTrainProblem

    problem = TransformerTrainProblem(8, CPU)
    assert "TransformerEncoder(2 layers, d_model 256" in problem.shape
    assert problem.flops > 3 * 2 * 16 * 8 * 4 * 256 * 256  # at least the projections' GEMMs
    assert problem.reference().dtype == torch.float64 and problem.reference().dim() == 0
    runner = problem.runner(FP32)
    assert problem.error(runner) < 1e-6  # fp32 against float64, from the same weights
    assert trains(runner, 10)  # AdamW really trains


def test_the_cuda_graphs_row_says_why_on_a_cpu_and_the_compiled_rows_describe_the_step() -> None:
    workload = WORKLOADS["transformer-train"]
    assert [c.name for c in workload.configs] == [
        "fp32", "amp-bf16", "compiled+amp-bf16", "cuda-graphs+amp-bf16"
    ]  # fmt: skip
    graphs = workload.config("cuda-graphs+amp-bf16")
    reason = graphs.unavailable(CPU)
    assert reason is not None and reason.startswith("no effect on cpu: CUDA graphs record")
    assert not graphs.emulated(CPU)  # refused here, never measured as "emulated"
    assert graphs.describe() == "@speedup(cuda_graphs=True, amp='bf16') around each call"
    compiled = workload.config("compiled+amp-bf16")
    assert not compiled.identical_to_baseline() and not graphs.identical_to_baseline()
    step = compiled.around(lambda: None, CPU)
    assert step.stats.compile_options == {} and step.stats.mode == "pending"  # not run yet
    with pytest.raises(ValueError, match=r"Config\.step='jit'"):
        Config("x", step="jit")
