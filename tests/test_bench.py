"""python -m speedflags bench: in process at tiny sizes, and as real subprocesses.

Also the pytest session table of ``benchmarks/`` (its conftest), run as a subprocess.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import speedflags
from speedflags.__main__ import main
from speedflags._measure.workloads import WORKLOADS
from speedflags.bench import cli
from speedflags.bench.results import BenchRun

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--sizes", "32", "--passes", "1", "--rounds", "1", "--min-time", "0"]
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (pip install '.[plot]')",
)


def bench(*args: str) -> int:
    return main(["bench", *TINY, *args])


def test_cli_names_every_workload() -> None:
    assert tuple(WORKLOADS) == cli.WORKLOAD_NAMES


def test_bench_prints_the_table_and_proves_the_flags_came_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = speedflags.snapshot()
    assert bench("--workload", "matmul,sdpa") == 0
    captured = capsys.readouterr()
    out = captured.out
    header = next(line for line in out.splitlines() if line.startswith("group"))
    assert header.split() == [
        "group", "config", "median", "speedup", "FLOP/s", "%", "of", "fastest", "rel.", "error",
    ]  # fmt: skip
    rows = [line.split() for line in out.splitlines()]
    assert ["matmul", "cpu", "32", "fp32"] in [row[:4] for row in rows]
    assert ["sdpa", "cpu", "32", "math"] in [row[:4] for row in rows]
    assert "skipped:" in out and "tf32: no effect on cpu" in out
    assert "flags: every lever reads as it did before the run" in out
    assert "[  1/" in captured.err and "matmul cpu 32 fp32, pass 1/1" in captured.err
    assert speedflags.snapshot() == before


def test_the_run_says_up_front_how_long_it_will_take(capsys: pytest.CaptureFixture[str]) -> None:
    # Failed before: `bench` with no options ran 5 min 46 s on a busy CPU without a word of
    # how long it would take. The figure is an estimate: only that it is said, before the
    # first measurement, and set beside what the run took at the end, is asserted.
    assert bench("--workload", "matmul") == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("speedflags bench: about "), err[0]
    assert "estimated from float32 matmuls here now: " in err[0] and "GFLOP/s" in err[0]
    assert any(line.startswith("[  1/") for line in err[1:])
    assert err[-1].startswith("took ") and "(estimated: " in err[-1]


def test_the_estimate_follows_the_plan() -> None:
    # made-up speeds: 100 GFLOP/s, no latency; nothing is timed
    from speedflags.bench.estimate import Calibration, CallModel
    from speedflags.bench.runner import Settings

    now = Calibration(CallModel(0.0, 1e11), CallModel(0.0, 1e11))
    cpu = torch.device("cpu")
    one = Settings(cpu, ("matmul",), sizes=(1024,), passes=1, verify=False).estimated_s(now)
    three = Settings(cpu, ("matmul",), sizes=(1024,), passes=3, verify=False).estimated_s(now)
    two_sizes = Settings(cpu, ("matmul",), sizes=(1024, 2048), passes=3, verify=False)
    assert 0 < one < three < two_sizes.estimated_s(now)
    # a workload the device lacks (conv: CUDA only) costs nothing
    with_conv = Settings(cpu, ("matmul", "conv"), sizes=(1024,), passes=3, verify=False)
    assert with_conv.estimated_s(now) == three


def test_a_size_some_workloads_cannot_take_is_not_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Failed before: `bench --device cpu --sizes 512` refused the whole run ("convnet-train
    # at size 512 needs at least 54 GiB"); now that workload is skipped with its reason. The
    # size is the smallest the convnet's estimate does not fit in this machine's memory.
    from speedflags._measure.workloads import memory_bytes

    have = memory_bytes(torch.device("cpu"))
    if have is None:
        pytest.skip("this system does not say how much memory it has")
    size = 1
    while WORKLOADS["convnet-train"].memory(size, "cpu") <= have:
        size *= 2
    assert main(["bench", *TINY[:2], "--workload", "convnet-train,matmul", "--sizes", str(size),
                 *TINY[4:]]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"  convnet-train cpu {size}  (all): convnet-train at size {size} needs at least" in out
    assert any(
        line.split()[:4] == ["matmul", "cpu", str(size), "fp32"] for line in out.splitlines()
    )


def test_json_says_where_the_results_came_from(tmp_path: Path) -> None:
    path = tmp_path / "results" / "cpu.json"
    assert bench("--workload", "matmul", "--json", str(path), "--threads", "1") == 0
    data = json.loads(path.read_text())
    env = data["environment"]
    for key in ("device", "device_name", "driver", "torch", "capabilities", "flags", "date"):
        assert key in env
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert env["threads"] == 1  # --threads applies to the run ...
    assert data["settings"]["sizes"] == [32]
    assert data["flags_restored"] is True and data["interrupted"] is False
    assert {r["config"] for r in data["results"]} >= {"fp32", "tf32"}
    assert BenchRun.load(str(path)).results[0].config == "fp32"


def test_threads_are_put_back_after_the_run() -> None:
    threads = torch.get_num_threads()
    assert bench("--workload", "matmul", "--threads", "1") == 0
    assert torch.get_num_threads() == threads  # ... and only to the run


def test_compare_two_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert bench("--workload", "matmul", "--json", str(a)) == 0
    assert bench("--workload", "matmul", "--json", str(b)) == 0
    capsys.readouterr()
    assert main(["bench", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: ")
    assert any(line.split()[:3] == ["matmul", "32", "fp32"] for line in out.splitlines())


def test_compare_reports_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.json").write_text("[]")
    assert main(["bench", "--compare", str(tmp_path / "x.json"), str(tmp_path / "no")]) == 2
    assert "not a speedflags bench result file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "1,x"], "--sizes '1,x'"),
        (["--sizes", "0"], "positive integers"),
        (["--workload", "matmul,gemm"], "unknown 'gemm'"),
        (["--passes", "0"], "--passes 0"),
        (["--min-time", "-1"], "--min-time -1"),
        (["--threads", "0"], "--threads 0"),
    ],
)
def test_bad_arguments_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_device_and_missing_cuda_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "gpu"]) == 2
    assert "--device 'gpu': not a device PyTorch knows" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_ctrl_c_prints_the_results_so_far_and_restores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown: list[Any] = []
    real_show = cli._show

    def show(event: Any) -> None:  # Ctrl-C right after the first measurement
        real_show(event)
        shown.append(event)
        if event.kind == "done":
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_show", show)
    before = speedflags.snapshot()
    path = tmp_path / "partial.json"
    assert bench("--workload", "matmul,sdpa", "--json", str(path)) == 130
    out, err = capsys.readouterr()
    # when it stopped, not "took" (an interrupted run never took the estimate's time)
    assert err.splitlines()[-1].startswith("stopped after ") and "(estimated: " in err
    assert "interrupted (Ctrl-C): the results so far" in out
    assert "matmul cpu 32  fp32" in out and "sdpa" not in out
    assert "flags: every lever reads as it did before the run" in out
    assert speedflags.snapshot() == before
    assert not speedflags.ledger().open_frames()
    data = json.loads(path.read_text())
    assert data["interrupted"] is True
    assert [r["config"] for r in data["results"] if not r["skipped"]] == ["fp32"]


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "plot.png"
    assert bench("--workload", "matmul", "--plot", str(path)) == 2
    err = capsys.readouterr().err
    # a form that works from this repository; the index's only as what it will be
    assert "pip install '.[plot]' in a checkout of speedflags" in err
    assert "(once it is published: pip install 'speedflags[plot]')" in err
    assert not path.exists()


@needs_matplotlib
def test_plot_writes_a_png_with_one_point_per_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plot.png"
    assert (
        bench("--workload", "matmul", "--plot", str(path), "--json", str(tmp_path / "r.json")) == 0
    )
    measured = [r for r in BenchRun.load(str(tmp_path / "r.json")).results if not r.skipped]
    assert f"plot: {path} ({len(measured)} points)" in capsys.readouterr().out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "speedflags", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_python_dash_m_bench_smoke(tmp_path: Path) -> None:
    path = tmp_path / "smoke.json"
    result = run_cli("bench", *TINY, "--workload", "matmul", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert "flags: every lever reads as it did before the run" in result.stdout
    assert BenchRun.load(str(path)).flags_restored


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT")
def test_a_real_ctrl_c_stops_cleanly() -> None:
    # The run cannot end before the Ctrl-C, however busy the machine: its progress goes to
    # a pipe that this test stops reading after the first progress line, and it has more
    # progress to write (30 sizes, 6 configurations, 100 passes: 18,000 lines, over 1 MiB)
    # than a pipe holds (64 KiB). Failed before on a busy machine (load 6-10): "many passes
    # at a small size" were meant to outlast the Ctrl-C, and the run could end first.
    sizes = ",".join(str(16 + 2 * i) for i in range(30))
    args = ["bench", "--device", "cpu", "--workload", "matmul,sdpa", "--sizes", sizes,
            "--passes", "100", "--rounds", "1", "--min-time", "0"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedflags", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # Ctrl-C as by default in the run, as in a terminal: a suite started in the
        # background by a shell without job control ignores SIGINT, and the run would inherit
        # that and finish (exit 0) instead of stopping
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("[  1/"):
                break
        assert proc.poll() is None, "the run ended before the Ctrl-C"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)  # a bound for a hang, never reached otherwise
    finally:
        if proc.poll() is None:  # never leave it running, whatever failed above
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C): the results so far" in out
    assert "matmul cpu 16  fp32" in out
    assert "flags: every lever reads as it did before the run" in out


def run_pytest(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # Not as a pytest-xdist worker's child: pytest-benchmark reads PYTEST_XDIST_WORKER and
    # turns itself off ("--benchmark-disable is automatically activated if xdist is on").
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def test_benchmark_session_table_follows_pytest_benchmarks_own() -> None:
    # Attention: both CPU kernels run on any CPU (the matmul levers need bf16 instructions).
    result = run_pytest(
        "benchmarks/test_sdpa.py",
        "--benchmark-only",
        "--bench-sizes",
        "32",
        "-k",
        "cpu and (math or flash)",
        "--benchmark-min-rounds=1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "speedflags: median per call" in out
    assert out.index("Legend:") < out.index("speedflags: median per call")
    table = out[out.index("speedflags: median per call") :].splitlines()
    # the baseline first, though pytest ran flash first
    baseline = next(i for i, line in enumerate(table) if " math " in line)
    assert table[baseline].split()[:4] == ["sdpa", "cpu", "32", "math"]
    assert "1.00x" in table[baseline].split()
    assert table[baseline + 1].split()[0] == "flash"


def test_other_benchmark_files_can_declare_their_baseline(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "benchmarks" / "conftest.py").read_text())
    (tmp_path / "test_other.py").write_text(
        "import pytest\n"
        "@pytest.mark.benchmark(group='sleepers')\n"
        "@pytest.mark.parametrize('variant', ['slow', 'fast'])\n"
        "def test_other(benchmark, variant):\n"
        "    if variant == 'slow':\n"
        "        benchmark.extra_info['baseline'] = True\n"
        "    n = 20000 if variant == 'slow' else 2000\n"
        "    benchmark.pedantic(sum, args=(range(n),), rounds=20)\n"
    )
    (tmp_path / "test_named.py").write_text(  # the BASELINES way, matching one parameter
        "import pytest\n"
        "@pytest.mark.parametrize('device', ['cpu'])\n"
        "@pytest.mark.parametrize('variant', ['speedup-bf16', 'fp32-eager'])\n"
        "def test_named(benchmark, device, variant):\n"
        "    benchmark.group = f'train-step-{device}'\n"
        "    n = 20000 if variant == 'fp32-eager' else 2000\n"
        "    benchmark.pedantic(sum, args=(range(n),), rounds=20)\n"
    )
    result = run_pytest("--benchmark-only", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("speedflags: median per call") :].splitlines()
    for baseline, other in (("slow", "fast"), ("fp32-eager-cpu", "speedup-bf16-cpu")):
        base = next(line for line in table if f" {baseline} " in line)
        faster = next(line for line in table if f" {other} " in line)
        assert "1.00x" in base.split()
        speedup = next(cell for cell in faster.split() if cell.endswith("x"))
        assert float(speedup.rstrip("x")) > 1.0  # summing 10x fewer numbers is faster
