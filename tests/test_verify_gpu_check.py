"""make gpu-check's driver and summary, on a CPU (the GPU parts are the same code paths)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import speedflags
from speedflags._verify import gpu_check, summary
from speedflags._verify.peaks import peak_for
from speedflags.bench.runner import Settings
from speedflags.bench.runner import run as bench

ROOT = Path(__file__).resolve().parent.parent


def test_the_plan_runs_the_gpu_tests_first_and_the_suite_only_on_a_gpu(tmp_path: Path) -> None:
    cpu = gpu_check.plan(str(tmp_path), gpu=False)
    gpu = gpu_check.plan(str(tmp_path), gpu=True)
    assert [s.name for s in cpu] == [s.name for s in gpu]
    by_name = {s.name: s for s in gpu}
    tests = [a for a in by_name["gpu-tests"].argv if a.startswith("tests/")]
    assert tests == [
        f"tests/test_gpu_{n}.py" for n in ("compile", "kernels", "tf32", "torch_writes", "training")
    ]
    # the untimed suite runs beside the GPU tests, in shards; verify waits for it (it measures)
    shards = [s for s in gpu if s.name.startswith("suite-")]
    assert [s.name for s in gpu[: len(shards) + 1]] == [*(s.name for s in shards), "gpu-tests"]
    assert all(s.alongside for s in shards) and not by_name["gpu-tests"].alongside
    assert by_name["verify"].quiet
    sharded = [a for s in shards for a in s.argv if a.startswith("tests/")]
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(sharded) == [f for f in every if not f.startswith("tests/test_gpu_")]
    assert cpu[0].why_skipped and not gpu[0].why_skipped
    override = next(s for s in gpu if s.name == "verify-tf32-override")
    assert override.env == {"NVIDIA_TF32_OVERRIDE": "0"} and override.expect == 1
    bench_cpu = next(s for s in cpu if s.name == "bench").argv
    assert "--sizes" in bench_cpu and "cpu" in bench_cpu
    assert "--sizes" not in next(s for s in gpu if s.name == "bench").argv  # default sizes
    written = [a.split("=", 1)[1] for s in cpu for a in s.argv if a.startswith("--junitxml=")]
    written += [s.argv[i + 1] for s in cpu for i, a in enumerate(s.argv) if a == "--json"]
    assert len(written) == 5 + len(shards) and all(w.startswith(str(tmp_path)) for w in written)


def test_a_step_alongside_runs_beside_the_next_and_is_waited_for_before_a_quiet_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "slow-done"
    slow = f"import time, pathlib; time.sleep(2); pathlib.Path({str(marker)!r}).touch()"
    quiet = f"import pathlib, sys; sys.exit(0 if pathlib.Path({str(marker)!r}).exists() else 5)"
    early = f"import pathlib, sys; sys.exit(0 if not pathlib.Path({str(marker)!r}).exists() else 6)"
    steps = [
        gpu_check.Step("slow", ["-c", slow], 60, alongside=True),
        gpu_check.Step("beside", ["-c", early], 60),  # ran while slow still slept
        gpu_check.Step("quiet", ["-c", quiet], 60, quiet=True),  # ran after slow ended
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda out, gpu: steps)
    monkeypatch.setattr(gpu_check, "_installed", lambda python: True)  # never pip install
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    recorded = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [(r["name"], r["status"]) for r in recorded] == [
        ("slow", "passed"), ("beside", "passed"), ("quiet", "passed"),
    ]  # fmt: skip
    assert recorded[0]["seconds"] >= 2


def test_a_step_passes_fails_or_is_skipped_by_its_exit_status(tmp_path: Path) -> None:
    py = sys.executable
    ok = gpu_check._run(gpu_check.Step("ok", ["-c", "print('hi')"], 60), str(tmp_path), py, 500)
    assert ok["status"] == "passed" and ok["rc"] == 0
    assert "hi" in (tmp_path / "ok.log").read_text()
    three = gpu_check.Step("three", ["-c", "raise SystemExit(3)"], 60, expect=3)
    assert gpu_check._run(three, str(tmp_path), py, 500)["status"] == "passed (exit 3, as expected)"
    bad = gpu_check.Step("bad", ["-c", "raise SystemExit(2)"], 60)
    assert gpu_check._run(bad, str(tmp_path), py, 500)["status"] == "FAILED (exit 2, expected 0)"
    late = gpu_check._run(gpu_check.Step("late", ["-c", "0"], 60), str(tmp_path), py, 10)
    assert late["status"] == "skipped: out of time"
    slow = gpu_check.Step("slow", ["-c", "import time; time.sleep(30)"], 15)
    assert gpu_check._run(slow, str(tmp_path), py, 500)["status"] == "TIMED OUT after 15 s"


def test_the_summary_joins_verdicts_speedups_and_throughput(tmp_path: Path) -> None:
    run = speedflags.verify("cpu", levers=["sdpa"])
    run.save(str(tmp_path / "verify.json"))
    settings = Settings(torch.device("cpu"), ("sdpa",), sizes=(16,), passes=1, min_rounds=1,
                        min_time_s=0, warmup_rounds=1, warmup_s=0)  # fmt: skip
    bench(settings).save(str(tmp_path / "bench.json"))
    env = {"device": "cpu", "torch": torch.__version__, "gpu_found": False}
    (tmp_path / "environment.json").write_text(json.dumps(env))
    steps = {"steps": [{"name": "verify", "status": "passed", "seconds": 3.2, "log": "v.log"}]}
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    text = summary.render(str(tmp_path))
    assert text.startswith("# speedflags gpu-check: no CUDA device")
    assert "| verify | passed | 3 | v.log |" in text
    flash = next(line for line in text.splitlines() if line.startswith("| sdpa=['flash']"))
    if speedflags.capabilities("cpu").flash_sdpa:
        assert "| verified |" in flash and "sdpa 16: " in flash  # the bench speedup beside it
    assert "| sdpa cpu 16 | flash |" in text  # throughput row (no peak known for a CPU)


def test_missing_files_are_said_not_raised(tmp_path: Path) -> None:
    text = summary.render(str(tmp_path))
    assert "verify did not run" in text and "bench did not run" in text


def test_throughput_against_the_dense_peak_of_the_arithmetic() -> None:
    results = {"results": [
        {"workload": "matmul", "config": "fp32", "group": "matmul cuda:0 8192", "flop_per_s": 5e13},
        {"workload": "matmul", "config": "tf32", "group": "matmul cuda:0 8192", "flop_per_s": 4e14},
        {"workload": "matmul", "config": "precision-medium", "group": "matmul cuda:0 8192",
         "device": "cuda", "flop_per_s": 3.3e14},
        {"workload": "sdpa", "config": "flash", "group": "sdpa cuda:0 4096", "flop_per_s": 5e14,
         "shape": "q, k, v (4, 16, 4096, 128) bfloat16"},
        {"workload": "matmul", "config": "amp-fp16", "group": "g", "skipped": "no"},
    ]}  # fmt: skip
    rows = summary.throughput_rows(results, "NVIDIA H100 80GB HBM3")
    assert rows == [
        ("matmul cuda:0 8192", "fp32", "50", "fp32", "75% of 66.9"),
        ("matmul cuda:0 8192", "tf32", "400", "tf32", "81% of 494.7"),
        ("matmul cuda:0 8192", "precision-medium", "330", "tf32", "67% of 494.7"),
        ("sdpa cuda:0 4096", "flash", "500", "bf16", "51% of 989.4"),
    ]


@pytest.mark.parametrize(
    ("name", "label"),
    [("NVIDIA H100 80GB HBM3", "H100 SXM5"), ("NVIDIA H100 PCIe", "H100 PCIe"),
     ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"),
     ("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", "RTX 4090")],
)  # fmt: skip
def test_peaks_are_found_by_the_device_name(name: str, label: str) -> None:
    found = peak_for(name)
    assert found is not None and found[0] == label
    assert found[1]["bf16"] >= found[1]["tf32"] >= found[1]["fp32"] > 0
