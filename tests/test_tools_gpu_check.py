"""make gpu-check's driver and summary (tools/gpu_check/), on a CPU (the GPU parts are the
same code paths)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

import speedflags
from speedflags.bench.runner import Settings
from speedflags.bench.runner import run as bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's tools/: not part of the installed package
from tools.gpu_check import check as gpu_check  # noqa: E402
from tools.gpu_check import steps as gpu_steps  # noqa: E402
from tools.gpu_check import summary  # noqa: E402
from tools.gpu_check.peaks import peak_for  # noqa: E402


@pytest.mark.parametrize("workers", [0, 8], ids=["shards", "xdist"])
def test_the_plan_runs_the_gpu_tests_first_and_the_suite_only_on_a_gpu(
    tmp_path: Path, workers: int
) -> None:
    cpu = gpu_check.plan(str(tmp_path), gpu=False, suite_workers=workers)
    gpu = gpu_check.plan(str(tmp_path), gpu=True, suite_workers=workers)
    assert [s.name for s in cpu] == [s.name for s in gpu]
    by_name = {s.name: s for s in gpu}
    tests = [a for a in by_name["gpu-tests"].argv if a.startswith("tests/")]
    gpu_files = ("compile", "cuda_graphs", "fp8", "kernels", "tf32", "torch_writes", "training")
    assert tests == [f"tests/test_gpu_{n}.py" for n in gpu_files]
    # the untimed suite runs beside the GPU tests; verify waits for it (it measures)
    suite = [s for s in gpu if s.group == "suite"]
    assert len(suite) == (8 if workers == 0 else 1)
    assert [s.name for s in gpu[: len(suite) + 1]] == [*(s.name for s in suite), "gpu-tests"]
    assert all(s.alongside for s in suite) and not by_name["gpu-tests"].alongside
    assert by_name["verify"].quiet
    sharded = [a for s in suite for a in s.argv if a.startswith("tests/")]
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(sharded) == [f for f in every if not f.startswith("tests/test_gpu_")]
    for step in suite:  # inductor compiles in the process, two threads each
        assert step.env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
        assert step.env["OMP_NUM_THREADS"] == "2"
        assert "-m" in step.argv and "not cuda" in step.argv
    if workers:
        argv = suite[0].argv
        assert argv[argv.index("-n") + 1] == "8" and "loadfile" in argv
        assert sharded == gpu_check.suite_files()  # the heaviest files first
    assert cpu[0].why_skipped and not gpu[0].why_skipped
    override = next(s for s in gpu if s.name == "verify-tf32-override")
    assert override.env == {"NVIDIA_TF32_OVERRIDE": "0"} and override.expect == 1
    bench_cpu = next(s for s in cpu if s.name == "bench").argv
    assert "--sizes" in bench_cpu and "cpu" in bench_cpu
    assert "--sizes" not in next(s for s in gpu if s.name == "bench").argv  # default sizes
    assert [s.name for s in gpu if s.gpu_state] == ["fp8-headroom", "train-step", "bench"]
    assert not any(s.gpu_state for s in cpu)
    written = [a.split("=", 1)[1] for s in cpu for a in s.argv if a.startswith("--junitxml=")]
    written += [s.argv[i + 1] for s in cpu for i, a in enumerate(s.argv) if a == "--json"]
    assert len(written) == 8 + len(suite) and all(w.startswith(str(tmp_path)) for w in written)
    names = {Path(w).name for w in written}
    assert {"fp8-headroom.json", "train-step.json", "overhead.json"} <= names


def test_the_heaviest_files_start_first_and_the_shards_weigh_alike() -> None:
    files = gpu_check.suite_files()
    seconds = gpu_steps.SUITE_SECONDS
    heavy = [f for f in files if f in seconds]
    assert files[: len(heavy)] == heavy
    weights = [seconds[f] for f in heavy]
    assert weights == sorted(weights, reverse=True)
    shards = gpu_check.suite_shards(8)
    assert sorted(f for shard in shards for f in shard) == sorted(files)
    loads = [sum(seconds.get(f, 2) for f in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(seconds.values())


def test_steps_are_chosen_by_name_and_the_bench_takes_its_arguments(tmp_path: Path) -> None:
    steps = gpu_check.plan(
        str(tmp_path), gpu=True, bench_args=["--workload", "matmul", "--passes", "2"],
        suite_workers=0,
    )  # fmt: skip
    bench_argv = next(s for s in steps if s.name == "bench").argv
    assert bench_argv[-4:] == ["--workload", "matmul", "--passes", "2"]
    gpu_check.select(steps, ["suite", "bench", "fp8-headroom"], skipped=["fp8-headroom"])
    running = [s.name for s in steps if not s.why_skipped]
    assert running == [*(f"suite-{i}" for i in range(1, 9)), "bench"]
    assert next(s for s in steps if s.name == "fp8-headroom").why_skipped == "not chosen (--skip)"
    assert (
        next(s for s in steps if s.name == "verify").why_skipped == "not chosen (--steps, --preset)"
    )
    with pytest.raises(ValueError, match="no step benchmark; steps: suite, gpu-tests"):
        gpu_check.select(steps, ["benchmark"])
    again = ["tests/test_bench.py", "tests/test_tf32.py::test_x"]  # a second call's reruns
    xdist = gpu_check.plan(str(tmp_path), gpu=True, suite_workers=4, suite_tests=again)
    assert xdist[0].name == "suite" and xdist[0].argv[-2:] == again
    shards = gpu_check.plan(str(tmp_path), gpu=True, suite_workers=0, suite_tests=again)
    assert [s.argv[-1] for s in shards if s.group == "suite"] == again
    first, budget, suite_cap = gpu_check.PRESETS["first"]
    assert "benchmarks" not in first and "suite" in first and budget + 20 <= 420
    assert suite_cap < budget
    assert gpu_check.PRESETS["second"][0] == ("gpu-tests",)


def test_a_step_alongside_runs_beside_the_next_and_is_waited_for_before_a_quiet_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each waits for an event, never for seconds: slow ends only once beside has looked (it
    # slept 2 s before, which a busy machine's start-up of beside could outlast)
    marker, looked = tmp_path / "slow-done", tmp_path / "beside-looked"
    slow = (
        f"import time, pathlib\nwhile not pathlib.Path({str(looked)!r}).exists(): "
        f"time.sleep(0.02)\npathlib.Path({str(marker)!r}).touch()"
    )
    quiet = f"import pathlib, sys; sys.exit(0 if pathlib.Path({str(marker)!r}).exists() else 5)"
    early = (
        f"import pathlib, sys; early = not pathlib.Path({str(marker)!r}).exists(); "
        f"pathlib.Path({str(looked)!r}).touch(); sys.exit(0 if early else 6)"
    )
    steps = [
        gpu_check.Step("slow", ["-c", slow], 60, alongside=True),
        gpu_check.Step("beside", ["-c", early], 60),  # ran while slow still slept
        gpu_check.Step("quiet", ["-c", quiet], 60, quiet=True),  # ran after slow ended
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda out, gpu, **_: steps)
    monkeypatch.setattr(gpu_check, "_installed", lambda python: True)  # never pip install
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    recorded = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [(r["name"], r["status"]) for r in recorded] == [
        ("slow", "passed"), ("beside", "passed"), ("quiet", "passed"),
    ]  # fmt: skip


def test_a_chosen_subset_runs_and_at_most_eight_files_are_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, target = tmp_path / "work", tmp_path / "export"
    wrote = f"import pathlib; pathlib.Path({str(out / 'verify.json')!r}).write_text('{{}}')"
    steps = [
        gpu_check.Step("suite-1", ["-c", "raise SystemExit(1)"], 60, alongside=True),
        gpu_check.Step("gpu-tests", ["-c", "print('gpu tests')"], 60),
        gpu_check.Step("verify", ["-c", wrote], 60, quiet=True),
        gpu_check.Step("bench", ["-c", "raise SystemExit(1)"], 60),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda out, gpu, **_: steps)
    monkeypatch.setattr(gpu_check, "_installed", lambda python: True)  # never pip install
    argv = ["--out", str(out), "--preset", "second", "--steps", "verify", "--export", str(target)]
    assert gpu_check.main(argv) == 0  # the failing steps were not chosen
    recorded = {
        r["name"]: r["status"] for r in json.loads((out / "steps.json").read_text())["steps"]
    }
    left_out = "skipped: not chosen (--steps, --preset)"
    assert recorded == {
        "suite-1": left_out, "gpu-tests": "passed", "verify": "passed", "bench": left_out,
    }  # fmt: skip
    exported = sorted(p.name for p in target.iterdir())
    assert len(exported) <= 8 and all(p.is_file() for p in target.iterdir())
    assert exported == sorted(
        ["gpu-check.tar.gz", "summary.md", "steps.json", "environment.json", "verify.json"]
    )
    with tarfile.open(target / "gpu-check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-check/gpu-tests.log", "gpu-check/verify.log", "gpu-check/summary.md"} <= names
    env = json.loads((out / "environment.json").read_text())
    assert env["host_cpu"]["logical_cores"] == os.cpu_count() and env["host_cpu"]["model"]
    assert "pytest" in env["packages"]
    with pytest.raises(SystemExit):  # the export folder must not be the work folder
        gpu_check.main(["--out", str(out), "--export", str(out)])
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(out), "--steps", "verify,nonsense"])


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


@pytest.mark.skipif(os.name != "posix", reason="process groups and Ctrl-C as a signal")
def test_a_step_past_its_cap_is_asked_to_stop_then_killed_with_its_children(
    tmp_path: Path,
) -> None:
    # The step starts a child that ignores Ctrl-C, and then, Ctrl-C'd itself, writes what it
    # has (as pytest writes its JUnit file) and goes on sleeping: after the grace, both die.
    # Its cap counts from when it is ready (its child started, its Ctrl-C handler in place),
    # set so that only the grace is left: failed before on a busy machine (load 6-10), where
    # the step's start-up took most of its cap and the Ctrl-C came before it could catch it.
    marker, pid_file, ready = tmp_path / "wrote-results", tmp_path / "child.pid", tmp_path / "ready"
    code = (
        "import pathlib, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
        f"try:\n    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(120)\n"
        f"except KeyboardInterrupt:\n    pathlib.Path({str(marker)!r}).touch()\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(120)\n"
    )
    slow = gpu_check.Step("slow", ["-c", code], 16)
    # as in a check started in the background by a shell without job control, which ignores
    # SIGINT (its children inherit it): failed before, the step never saw the Ctrl-C
    ignoring = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        launched = gpu_check._launch(slow, str(tmp_path), sys.executable, 500)
    finally:
        signal.signal(signal.SIGINT, ignoring)
    assert isinstance(launched, gpu_check._Launched)
    _wait_for(ready.exists, "the step to be ready")
    grace = min(gpu_check.INTERRUPT_GRACE_S, launched.cap / 4)
    launched.started = time.perf_counter() - (launched.cap - grace)  # only the grace is left
    record = launched.finish()
    assert record["status"] == "TIMED OUT after 16 s" and record["rc"] is None
    assert marker.exists()  # it had the grace to write its results
    assert record["seconds"] >= 16  # its cap, from when it was ready
    child = int(pid_file.read_text())
    _wait_for(lambda: not _alive(child), f"the step's child {child} to end with the step")


def test_an_interrupted_check_leaves_no_step_running(tmp_path: Path) -> None:
    # Ctrl-C (or the SIGTERM of a caller's timeout, made SystemExit) while a step runs beside
    pid_file = tmp_path / "slow.pid"
    path = repr(str(pid_file))
    slow = f"import os, pathlib, time; pathlib.Path({path}).write_text(str(os.getpid()))\n"
    slow += "time.sleep(120)"
    # ends once the step beside has started for sure
    quick = f"import pathlib, time\nwhile not pathlib.Path({path}).exists(): time.sleep(0.05)"
    steps = [
        gpu_check.Step("slow", ["-c", slow], 300, alongside=True),
        gpu_check.Step("quick", ["-c", quick], 60),
    ]
    records: dict[str, dict[str, object]] = {}

    def done(record: dict[str, object]) -> None:
        raise KeyboardInterrupt  # as the first record comes in

    with pytest.raises(KeyboardInterrupt):
        gpu_check._run_steps(steps, str(tmp_path), sys.executable, 500, records, done)
    assert records["slow"]["status"] == "running"
    pid = int(pid_file.read_text())
    _wait_for(lambda: not _alive(pid), f"the step beside, {pid}, to end with the check")


def _wait_for(happened: Callable[[], bool], what: str, bound_s: float = 120.0) -> None:
    """Wait until ``happened()``; the bound only keeps a regression from hanging the suite
    (no test passes by waiting it out)."""
    deadline = time.monotonic() + bound_s
    while not happened():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {bound_s:.0f} s for {what}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


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


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_summary_has_the_fp8_train_step_overhead_and_test_sections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what the scripts write on a CPU (the same code writes it on a GPU)
    fp8 = _script("fp8_headroom")
    argv = ["--device", "cpu", "--sizes", "32", "--rounds", "1"]
    assert fp8.main([*argv, "--json", str(tmp_path / "fp8-headroom.json")]) == 0
    train = _script("train_step_interleaved")
    # the same model on smaller batches: bf16 on a CPU without bf16 instructions is slow
    monkeypatch.setattr(sys.modules["test_train_step"], "BATCH", 2)
    monkeypatch.setattr(sys.modules["test_train_step"], "SEQ", 8)
    variants = "fp32-eager,speedup-bf16,speedup-bf16-graphs"
    argv = ["--rounds", "2", "--variants", variants, "--json", str(tmp_path / "train-step.json")]
    assert train.main(argv) == 0
    # in its own process: its plain-torch baseline leaves torch's flags changed on purpose
    argv = ["--rounds", "2", "--calls", "20", "--json", str(tmp_path / "overhead.json")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead_interleaved.py"), *argv],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "goal: at most 1.5x plain torch: " in done.stdout
    (tmp_path / "suite.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="ok" time="3"/>'
        '<testcase classname="tests.test_b" name="bad" time="1"><failure message="boom\nmore"/>'
        '</testcase><testcase classname="tests.test_b" name="gone" time="0"><skipped/>'
        "</testcase></testsuite></testsuites>"
    )
    text = summary.render(str(tmp_path))
    assert (
        "| suite | 1 | 1 | 0 | 1 |" in text
        and "- suite, failed: tests/test_b.py::bad: boom" in text
    )
    assert "slowest files (test seconds): test_a.py 3 s, test_b.py 1 s" in text
    fp8_part = text[text.index("## FP8 headroom") : text.index("## Small transformer")]
    assert "A dry run on the CPU (" in fp8_part  # why: no GPU, or none with FP8, or the CPU asked
    assert "| 32 | fp32 |" in fp8_part and "| 32 | bf16 |" in fp8_part
    train_part = text[text.index("## Small transformer") : text.index("## Frame overhead")]
    assert "| fp32-eager |" in train_part and "| 1.00x |" in train_part
    assert "| speedup-bf16-graphs | - |" in train_part and "skipped: CUDA Graphs" in train_part
    data = json.loads((tmp_path / "train-step.json").read_text())
    bf16 = next(v for v in data["variants"] if v["variant"] == "speedup-bf16")
    assert bf16["parameters_moved"] > 0 and bf16["loss_rel_err_vs_baseline"] < 3e-2
    assert bf16["mode"] == "eager" and data["problems"] == []
    overhead_part = text[text.index("## Frame overhead") :]
    assert "| plain-torch |" in overhead_part and "| 1.00x |" in overhead_part
    assert "- goal: at most 1.5x plain torch: " in overhead_part
    assert "- goal: at most 2x plain torch: " in overhead_part


def test_a_train_step_variant_is_checked_by_name() -> None:
    train = _script("train_step_interleaved")
    with pytest.raises(SystemExit) as exc:
        train.main(["--variants", "fp32-eager,warp-speed"])
    assert exc.value.code == 2


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


def test_the_suite_cap_is_a_presets_unless_given() -> None:
    parser = gpu_check._parser()

    def settings(*argv: str) -> tuple[float, float]:
        _, budget, cap, _ = gpu_check._settings(parser, parser.parse_args(["--out", "x", *argv]))
        return budget, cap

    assert settings() == (530.0, 300.0)
    assert settings("--preset", "second") == (220.0, 200.0)
    assert settings("--preset", "second", "--budget", "400", "--suite-cap", "290") == (400.0, 290.0)
    with pytest.raises(SystemExit):
        settings("--suite-cap", "0")
