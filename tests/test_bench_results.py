"""speedflags.bench.results and .table: result files, provenance, the table, the comparison."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import speedflags
from speedflags.bench import results as results_module
from speedflags.bench.results import FORMAT, BenchRun, Result, environment
from speedflags.bench.table import finish, render, render_compare

GROUP = "matmul cpu 2048"


def rows() -> list[Result]:
    return [
        Result(GROUP, "fp32", "matmul", "cpu", 2048, baseline=True, median_s=0.2, flops=1.7e10),
        Result(GROUP, "precision-medium", "matmul", "cpu", 2048, median_s=0.1, flops=1.7e10),
        Result(GROUP, "amp-bf16", "matmul", "cpu", 2048, median_s=0.05, rel_error=2.9e-3),
        Result(GROUP, "tf32", "matmul", "cpu", 2048, skipped="no effect on cpu"),
        Result("enter-exit", "fast_math", median_s=14e-6),
    ]


def test_finish_speedup_and_share_of_fastest_per_group() -> None:
    done = {(r.group, r.config): r for r in finish(rows())}
    assert done[GROUP, "fp32"].speedup == 1.0
    assert done[GROUP, "precision-medium"].speedup == 2.0
    assert done[GROUP, "amp-bf16"].speedup == 4.0
    assert done[GROUP, "fp32"].pct_of_fastest == 25.0
    assert done[GROUP, "amp-bf16"].pct_of_fastest == 100.0
    assert done[GROUP, "tf32"].speedup is None  # skipped
    assert done["enter-exit", "fast_math"].speedup is None  # no baseline in its group
    assert done["enter-exit", "fast_math"].pct_of_fastest == 100.0


def test_render_shows_every_column_then_the_skipped() -> None:
    text = render(finish(rows()))
    lines = text.splitlines()
    assert lines[0].split() == [
        "group", "config", "median", "speedup", "FLOP/s", "%", "of", "fastest", "rel.", "error",
    ]  # fmt: skip
    fp32 = next(line for line in lines if " fp32 " in line)
    assert fp32.split() == [*GROUP.split(), "fp32", "200", "ms", "1.00x", "85", "G", "25%", "–"]
    assert any(line.split()[-1] == "2.9e-03" for line in lines)
    assert lines[lines.index("skipped:") + 1] == f"  {GROUP}  tf32: no effect on cpu"
    assert "14 us" in text


def test_render_groups_rows_that_arrive_interleaved() -> None:
    interleaved = [
        Result("a", "x", baseline=True, median_s=1.0),
        Result("b", "x", baseline=True, median_s=1.0),
        Result("a", "y", median_s=0.5),
    ]
    lines = render(finish(interleaved)).splitlines()[2:]
    assert [line.split()[:2] for line in lines] == [["a", "x"], ["y", "500"], ["b", "x"]]


def test_render_marks_levers_without_effect() -> None:
    text = render(finish([Result("g", "tf32+amp-bf16", median_s=1.0, notes=("tf32: none",))]))
    assert "tf32+amp-bf16 *" in text
    assert "  g  tf32+amp-bf16: tf32: none" in text
    assert render([]) == "(nothing measured)"


def run_with(results: list[Result], **env: Any) -> BenchRun:
    environment = {"device": "cpu", "device_name": "AMD EPYC", "torch": "2.13.0", "threads": 2}
    environment.update(env)
    return BenchRun(environment, {"passes": 3}, finish(results))


def test_compare_matches_rows_and_says_which_is_faster() -> None:
    a = run_with(rows(), date="2026-11-22")
    b_rows = [
        Result("matmul cuda 2048", "fp32", "matmul", "cuda", 2048, baseline=True, median_s=0.1),
        Result("matmul cuda 2048", "pure-bf16", "matmul", "cuda", 2048, median_s=0.01),
    ]
    b = run_with(b_rows, device="cuda:0", device_name="NVIDIA H100", driver="560.35")
    text = render_compare(a, b)
    assert text.splitlines()[0] == "A: AMD EPYC (cpu), PyTorch 2.13.0, 2 threads, 2026-11-22"
    assert "NVIDIA H100 (cuda:0), driver 560.35, PyTorch 2.13.0" in text.splitlines()[1]
    fp32 = next(
        line for line in text.splitlines() if line.split()[:3] == ["matmul", "2048", "fp32"]
    )
    assert "2.00x" in fp32.split()  # A 200 ms, B 100 ms: B is twice as fast
    pure = next(line for line in text.splitlines() if " pure-bf16 " in line)
    assert pure.split()[3] == "–"  # only in B
    assert "tf32" not in text.split("B/A: ")[0].split("---")[-1]  # skipped rows are not compared
    assert text.splitlines()[-1].startswith("B/A: A's median time over B's")


def test_result_round_trips_through_a_file(tmp_path: Path) -> None:
    run = run_with(rows())
    run.interrupted = True
    path = tmp_path / "sub" / "cpu.json"
    run.save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["interrupted"] is True
    assert data["results"][0]["flop_per_s"] == pytest.approx(1.7e10 / 0.2)
    loaded = BenchRun.load(str(path))
    assert loaded.results == run.results
    assert loaded.environment == run.environment
    assert loaded.interrupted is True


def test_load_refuses_other_files(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not JSON"):
        BenchRun.load(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not a speedflags bench result file"):
        BenchRun.load(str(tmp_path / "other.json"))


def test_environment_says_where_a_result_came_from() -> None:
    env = environment(torch.device("cpu"))
    assert env["device"] == "cpu"
    assert env["device_name"] == speedflags.capabilities("cpu").name
    assert env["torch"] == torch.__version__
    assert env["speedflags"] == speedflags.__version__
    assert env["threads"] == torch.get_num_threads()
    assert env["driver"] is None and env["gpu_state"] == {}
    assert env["capabilities"] == speedflags.capabilities("cpu").to_dict()
    assert env["flags"] == speedflags.snapshot()
    json.dumps(env)  # a result file can hold it as it is


def test_cpu_id_reads_family_model_and_the_features_that_matter(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16 vaes\n"
        "\nprocessor\t: 1\ncpu family\t: 99\n"
    )
    assert results_module.cpu_id(str(info)) == {
        "vendor_id": "AuthenticAMD",
        "cpu family": "25",
        "model": "17",
        "stepping": "1",
        "features": ["avx2", "avx512f", "avx512_bf16"],
    }


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``nvidia-smi`` on PATH that prints what a real one prints for the query."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'echo "$@" > "$(dirname "$0")/args"\n'
        'echo "560.35.03, 1980 MHz, 2619 MHz, 412.37 W, 61"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_gpu_environment_records_driver_clocks_and_power(
    fake_gpu: Callable[..., None], fake_nvidia_smi: Path
) -> None:
    fake_gpu((9, 0), name="NVIDIA H100 80GB HBM3")
    env = environment(torch.device("cuda"))
    assert env["device"] == "cuda:0"
    assert env["device_name"] == "NVIDIA H100 80GB HBM3"
    assert env["driver"] == "560.35.03"
    assert env["gpu_state"]["clocks.sm"] == "1980 MHz"
    assert env["gpu_state"]["power.draw"] == "412.37 W"
    assert env["cudnn"] == 91002
    assert "-i 0" in (fake_nvidia_smi / "args").read_text()


def test_no_nvidia_smi_means_no_gpu_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert results_module._nvidia_smi(0) == {}


def test_a_speedup_within_the_noise_of_its_passes_is_marked_and_said() -> None:
    # Made-up medians (no timing is asserted): per-pass ratios of 1.01x, 0.99x and 1.02x are
    # no difference beyond their noise; 2x in every pass is.
    same = [
        Result("g", "fp32", baseline=True, median_s=1.0, pass_medians_s=(1.0, 1.2, 1.1)),
        Result("g", "flash", median_s=0.99, pass_medians_s=(0.99, 1.21, 1.08)),
        Result("g", "medium", median_s=0.5, pass_medians_s=(0.5, 0.6, 0.55)),
    ]
    done = {r.config: r for r in finish(same)}
    assert done["flash"].within_noise and not done["medium"].within_noise
    assert done["medium"].noise == pytest.approx(0.0, abs=1e-12)
    assert not done["fp32"].within_noise  # the baseline is no comparison
    lines = render(list(done.values())).splitlines()
    flash = next(line for line in lines if " flash " in f" {line} ")
    # Failed before: the column said "1.01x ~" (and "param-bf16 8.76x ~" in a real run), a
    # figure beside "no difference shown"; now the column says "~", and the figure is given
    # below the table with its spread, as within the noise
    assert flash.split()[3] == "~" and "1.01x" not in flash, flash
    at = lines.index(next(line for line in lines if line.startswith("~ within the noise")))
    assert "no speedup shown" in lines[at]
    assert lines[at + 1].strip().startswith("g  flash: 1.01x ±")
    assert lines[at + 1].endswith(" over 3 passes")
    assert "~" not in next(line for line in lines if " medium " in f" {line} ")
    # a file keeps both: the noise and the word
    assert done["flash"].to_dict()["within_noise"] is True


def test_one_pass_without_quartiles_has_no_noise_and_no_mark() -> None:
    done = finish(rows())
    assert all(r.noise is None for r in done if not r.baseline and r.speedup is not None)
    assert "~" not in render(done)


def test_an_emulated_row_is_marked_and_said() -> None:
    emulated = [
        Result("g (emulated)", "fp32", baseline=True, median_s=0.001),
        Result("g (emulated)", "amp-bf16", median_s=0.05, verdict="in effect, emulated: slower"),
    ]
    text = render(finish(emulated))
    line = next(line for line in text.splitlines() if "amp-bf16" in line)
    assert "amp-bf16 (emulated)" in line and "0.02x" in line and "~" not in line
    assert "(emulated): in effect, emulated: slower: measured once, at a small size" in text
