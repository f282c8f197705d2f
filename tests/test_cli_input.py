"""Bad command-line input is refused before anything is measured, in one line, exit status 2.

``bench`` and ``tune`` check their output paths (``--json``, ``--plot``, ``--out``) for
writability, and their numbers for NaN, infinity and sizes that cannot be allocated, before
the run; no bad input ends in a traceback. A missing output folder is created, the same way
in both commands. A user's own step raising inside ``tune`` shows its traceback, with exit
status 3.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from speedflags.__main__ import main

TINY = ["--device", "cpu", "--sizes", "16", "--passes", "1", "--rounds", "1", "--min-time", "0"]
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (pip install '.[plot]')",
)

STEPS = """
import pathlib
import torch

MARKER = pathlib.Path(__file__).with_name("factory-ran")

def step():
    MARKER.write_text("the factory ran")
    return torch.sin, (torch.ones(8),)

def raises():
    def broken(x):
        raise RuntimeError("the user's own bug")
    return broken, (torch.ones(2),)
"""


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(STEPS))
    return path


@pytest.fixture
def under_a_file(tmp_path: Path) -> Path:
    """A folder that cannot exist: a regular file stands where it would be (root or not)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker / "out"


def _bench(args: list[str]) -> int:
    return main(["bench", "--workload", "matmul", *TINY, *args])


def _one_line_naming(err: str, option: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # no traceback, no progress: nothing was measured
    assert option in lines[0], lines[0]
    return lines[0]


# --- bench ----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["results.json", "deeper/results.json"])
def test_bench_refuses_a_json_path_under_a_file_before_measuring(
    under_a_file: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(["--json", str(under_a_file / suffix)]) == 2
    line = _one_line_naming(capsys.readouterr().err, "--json")
    assert line.startswith("speedflags bench: --json ") and "is a file" in line


def test_bench_refuses_a_folder_as_the_json_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench(["--json", str(tmp_path)]) == 2
    assert "a folder, not a file" in _one_line_naming(capsys.readouterr().err, "--json")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_bench_refuses_a_read_only_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert _bench(["--json", str(folder / "results.json")]) == 2
    finally:
        folder.chmod(0o755)
    assert "cannot create files in" in _one_line_naming(capsys.readouterr().err, "--json")


@needs_matplotlib
@pytest.mark.parametrize("name", ["a-file/plot.png", "plot", "plot.xyz"])
def test_bench_refuses_a_plot_it_could_not_write(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    assert _bench(["--plot", str(tmp_path / name)]) == 2
    _one_line_naming(capsys.readouterr().err, "--plot")
    assert not list(tmp_path.glob("plot*"))  # matplotlib would have written plot.png


@needs_matplotlib
def test_bench_creates_a_missing_plot_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new" / "deeper" / "speedup.png"
    assert _bench(["--plot", str(path)]) == 0
    assert path.is_file()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_bench_refuses_a_min_time_that_is_not_finite(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench([f"--min-time={value}"]) == 2  # "=": argparse reads "-inf" as an option
    assert f"--min-time {value}: must be a finite number" in capsys.readouterr().err


def test_bench_refuses_a_size_the_device_cannot_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench(["--sizes", "99999999999"]) == 2
    line = _one_line_naming(capsys.readouterr().err, "--sizes 99999999999")
    assert "matmul at size 99999999999 needs at least" in line and "cpu has" in line


def test_bench_refuses_more_threads_than_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    cpus = os.cpu_count() or 1
    assert _bench(["--threads", str(cpus + 1)]) == 2
    assert f"--threads {cpus + 1}: must be from 1 to {cpus}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "speedflags-bench/1", "results": [{"x": 1}]}', "not a speedflags bench"),
        ('{"format": "speedflags-bench/1", "results": [5]}', "not a speedflags bench"),
        ('{"format": "speedflags-bench/1", "results": 5}', "not a speedflags bench"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
    ids=["row-missing-fields", "row-not-a-table", "rows-not-a-list", "too-deep"],
)
def test_bench_compare_refuses_a_file_that_is_not_a_result(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert main(["bench", "--compare", str(path), str(path)]) == 2
    line = _one_line_naming(capsys.readouterr().err, "speedflags bench --compare: ")
    assert str(path) in line and message in line


@pytest.mark.parametrize("given", [["nope.json", "b.json"], ["a.json", "nope.json"]])
def test_bench_compare_names_the_option_and_the_missing_file(
    tmp_path: Path, given: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: "speedflags bench --compare: [Errno 2] No such file or directory: ..."
    existing = tmp_path / "a.json"
    existing.write_text('{"format": "speedflags-bench/1", "results": []}')  # a result file
    paths = [str(existing) if name == "a.json" else str(tmp_path / name) for name in given]
    assert main(["bench", "--compare", *paths]) == 2
    missing = next(p for p in paths if p.endswith("nope.json"))
    line = _one_line_naming(capsys.readouterr().err, f"--compare {missing!r}")
    assert line == f"speedflags bench: --compare {missing!r}: no such file"


def test_bench_compare_with_one_file_is_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--compare", "nope.json"]) == 2
    line = _one_line_naming(capsys.readouterr().err, "--compare")
    assert "expected 2 arguments" in line and "usage:" not in line


def test_bench_and_tune_refuse_a_gpu_index_the_machine_lacks(
    steps: Path,
    fake_gpu: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake_gpu()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["bench", "--device", "cuda:3", "--workload", "matmul"]) == 2
    line = _one_line_naming(capsys.readouterr().err, "--device 'cuda:3'")
    assert line.endswith("this machine has 1 CUDA device (cuda:0 and up)")
    assert main(["tune", f"{steps}:step", "--device", "cuda:3"]) == 2
    line = _one_line_naming(capsys.readouterr().err, "--device 'cuda:3'")
    assert line.endswith("this machine has 1 CUDA device (cuda:0 and up)")
    assert not (steps.parent / "factory-ran").exists()


# --- tune -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--out", "a-file/levers.json", "is a file, so no folder can be made under it"),
        ("--out", "a-file/new/levers.toml", "is a file, so no folder can be made under it"),
        ("--out", "levers.ini", "unknown file type '.ini'"),
        pytest.param("--plot", "a-file/plot.png", "is a file", marks=needs_matplotlib),
        pytest.param("--plot", "plot", "unknown file type '(none)'", marks=needs_matplotlib),
    ],
)
def test_tune_refuses_an_output_it_could_not_write_before_the_factory_runs(
    steps: Path, option: str, name: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (steps.parent / "a-file").write_text("not a folder")
    assert main(["tune", f"{steps}:step", option, str(steps.parent / name)]) == 2
    line = _one_line_naming(capsys.readouterr().err, option)
    assert line.startswith(f"speedflags tune: {option} ") and message in line
    assert not (steps.parent / "factory-ran").exists()


@pytest.mark.parametrize("levers", [",", " , ", "tf32,turbo"])
def test_tune_refuses_levers_naming_no_lever_or_an_unknown_one(
    steps: Path, levers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", f"{steps}:step", "--levers", levers]) == 2
    line = _one_line_naming(capsys.readouterr().err, f"--levers {levers!r}")
    assert (
        "valid: amp, compile, cudnn_benchmark, fp8, matmul_precision, memory_format, param_dtype, "
        "reduced_precision_reduction, sdpa, tf32" in line
    )
    assert not (steps.parent / "factory-ran").exists()


def test_tune_creates_a_missing_output_folder_as_bench_does(steps: Path) -> None:
    out = steps.parent / "new" / "deeper" / "levers.json"
    # tf32 has no effect on a CPU and sin has no matmul: nothing is timed, so this is quick
    args = ["tune", f"{steps}:step", "--levers", "tf32", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    assert out.is_file()


def test_tune_shows_the_traceback_of_a_step_that_raises_with_status_3(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", f"{steps}:raises", "--levers", "tf32", "--device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: the user's own bug" in err
    assert err.rstrip().splitlines()[-1].startswith("speedflags tune: the step raised RuntimeError")
