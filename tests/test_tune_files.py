"""speedflags._tune's files and command line: save/load round trips, the table, the plot,
and ``python -m speedflags tune`` with its errors.
"""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import speedflags
from speedflags.__main__ import main
from speedflags._measure.lever_files import to_toml
from speedflags._tune.result import Row
from speedflags.errors import InvalidTypeError, InvalidValueError
from speedflags.levers.registry import LEVER_NAMES

ROOT = Path(__file__).resolve().parent.parent
NO_COMPILE = list(LEVER_NAMES)  # every registry lever, without torch.compile (too slow here)


# --- files --------------------------------------------------------------------------------


def _result(best: dict[str, Any]) -> speedflags.TuneResult:
    rows = [
        Row(dict(best), speedup=1.7, error=4e-3, accepted=True, median_s=0.01, rounds=9),
        Row({"amp": "bf16"}, error=math.inf, note="rejected: output is not finite"),
        Row({"tf32": True}, note="skipped (no effect): no TF32 on a CPU"),
    ]
    return speedflags.TuneResult(best, rows, budget=0.05, device="cpu", reference_s=0.07)


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
@pytest.mark.parametrize(
    "best",
    [{"amp": "bf16"}, {"sdpa": ["flash", "math"], "matmul_precision": "medium"}, {}],
    ids=["amp", "sdpa", "fp32"],
)
def test_save_and_load_round_trip(tmp_path: Path, suffix: str, best: dict[str, Any]) -> None:
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    path = tmp_path / f"levers{suffix}"
    _result(best).save(path)
    levers = speedflags.load_levers(path)
    assert levers == best
    if levers:  # fast_math and speedup take what load_levers returns
        with speedflags.fast_math(**levers, device="cpu"):
            pass
        assert speedflags.speedup(**levers, device="cpu")(torch.sin)(torch.zeros(1)) == 0


def test_the_toml_written_reads_back_with_tomllib(tmp_path: Path) -> None:
    tomllib = pytest.importorskip("tomllib")
    data = _result({"amp": "bf16"}).to_dict()
    parsed = tomllib.loads(to_toml(data))
    assert parsed["levers"] == {"amp": "bf16"}
    assert parsed["tune"]["speedup"] == 1.7 and "compile" not in parsed["tune"]  # None: left out
    assert [r["levers"] for r in parsed["rows"]] == [
        {"amp": "bf16"},
        {"amp": "bf16"},
        {"tf32": True},
    ]
    assert "error" not in parsed["rows"][1]  # infinite: left out; the note says why


def test_load_levers_reads_a_hand_written_file_and_checks_it(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"amp": "bf16", "tf32": True}))
    assert speedflags.load_levers(path) == {"tf32": True, "amp": "bf16"}
    path.write_text(json.dumps({"levers": {"amp": "bf17"}}))
    with pytest.raises(InvalidValueError, match=r"mine.json.*amp='bf17'"):
        speedflags.load_levers(path)
    path.write_text(json.dumps({"levers": {"fast": True}}))
    with pytest.raises(InvalidTypeError, match="'fast' is not a lever"):
        speedflags.load_levers(path)
    path.write_text("{not json")
    with pytest.raises(InvalidValueError, match="not valid JSON"):
        speedflags.load_levers(path)
    with pytest.raises(InvalidValueError, match=r"unknown file type '.ini'.*\.json"):
        speedflags.load_levers(tmp_path / "levers.ini")
    with pytest.raises(FileNotFoundError):
        speedflags.load_levers(tmp_path / "missing.toml")


def test_a_missing_lever_file_is_a_speedflags_error_naming_the_file(tmp_path: Path) -> None:
    # Failed before: a raw FileNotFoundError ("[Errno 2] No such file or directory: ...").
    missing = tmp_path / "missing.toml"
    with pytest.raises(speedflags.LeverFileNotFoundError) as caught:
        speedflags.load_levers(missing)
    assert isinstance(caught.value, (FileNotFoundError, speedflags.SpeedflagsError))
    assert caught.value.filename == str(missing)
    assert str(caught.value).startswith(f"load_levers({str(missing)!r}): no such file")
    assert "[Errno" not in str(caught.value)


def test_yaml_without_pyyaml_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PyYAML is installed here; its absence is what a plain `pip install speedflags` gives
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match=r"pip install 'speedflags\[yaml\]'"):
        _result({"amp": "bf16"}).save(tmp_path / "levers.yaml")


def test_the_table_shows_every_row_and_the_choice() -> None:
    text = str(_result({"amp": "bf16"}))
    assert text.splitlines()[0].startswith("speedflags tune on cpu, error budget 0.05")
    assert "amp='bf16'" in text and "1.70x" in text and "inf" in text
    assert "skipped (no effect)" in text and text.splitlines()[-1] == "best: fast_math(amp='bf16')"
    assert "best: plain fp32 (no lever beats it within the budget)" in str(_result({}))


def test_a_choice_with_nothing_measured_says_so_rather_than_no_lever_beats_fp32() -> None:
    # on a CPU, TF32 and cuDNN autotuning are skipped as without effect: nothing was timed
    result = speedflags.tune(
        lambda x: x @ x, torch.ones(8, 8), levers=["tf32", "cudnn_benchmark"], device="cpu"
    )
    assert result.best == {} and all(row.speedup is None for row in result.rows)
    last = str(result).splitlines()[-1]
    assert last == (
        "best: plain fp32 (nothing was measured against it: every candidate was skipped or failed)"
    )


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "pareto.png"
    assert _result({"amp": "bf16"}).plot(path) == 2
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'speedflags\[plot\]'"):
        _result({}).plot(tmp_path / "pareto.png")


def test_import_speedflags_imports_no_extra() -> None:
    code = "import sys, speedflags; print(sorted({'matplotlib', 'yaml'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- the command line ------------------------------------------------------------------------

STEPS = """
import torch

def step():
    return torch.sin, (torch.ones(64),)

def with_kwargs():
    return (lambda x, *, k: x * k), (torch.ones(4),), {"k": 2.0}

def one_thing():
    return torch.sin

def not_callable():
    return 3, (torch.ones(1),)

def fails():
    raise RuntimeError("no data here")
"""


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(STEPS))
    return path


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing.py:step", "no such file"),
        ("{steps}:nope", "has no 'nope'; its callables: fails, not_callable, one_thing, step"),
        ("{steps}:one_thing", "must return (fn, args) or (fn, args, kwargs)"),
        ("{steps}:not_callable", "it returned (int, tuple)"),
        ("{steps}:fails", "fails() raised RuntimeError: no data here"),
        ("{steps}", "expected FILE.py:FACTORY"),
    ],
)
def test_cli_errors_say_what_is_wrong(
    steps: Path, target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", target.format(steps=steps)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speedflags tune: ") and message in err


@pytest.mark.parametrize("budget", ["0", "-1", "abc", "nan"])
def test_cli_refuses_a_budget_that_is_not_positive(
    steps: Path, budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: argparse printed its five-line usage block above the reason.
    assert main(["tune", f"{steps}:step", "--budget", budget]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"speedflags tune: --budget '{budget}'")
    assert "usage:" not in lines[0]


def test_cli_refuses_an_output_it_cannot_write_before_running(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", f"{steps}:step", "--out", "levers.ini"]) == 2
    assert "unknown file type" in capsys.readouterr().err


def test_cli_tunes_saves_and_prints_json(steps: Path, tmp_path: Path) -> None:
    out = tmp_path / "levers.json"
    result = subprocess.run(
        [sys.executable, "-m", "speedflags", "tune", f"{steps}:with_kwargs", "--seconds", "5",
         "--levers", "amp,matmul_precision", "--out", str(out), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["levers"] == speedflags.load_levers(out)
    assert {"levers", "tune", "rows"} <= set(data)
    assert "tune: reference: plain fp32" in result.stderr  # progress goes to stderr


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_load_levers_names_the_file_when_its_nesting_is_too_deep(
    tmp_path: Path, suffix: str
) -> None:
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    deep = "[" * 100_000 + "]" * 100_000  # each parser recurses once per level
    path = tmp_path / f"deep{suffix}"
    path.write_text("levers = " + deep if suffix == ".toml" else deep)
    with pytest.raises(InvalidValueError) as excinfo:
        speedflags.load_levers(path)
    message = str(excinfo.value)
    assert message.startswith(f"load_levers({str(path)!r}): not valid ")
    assert "nested too deeply" in message


@pytest.mark.parametrize("path", [None, 5, b"levers.json"])
def test_load_levers_refuses_an_argument_that_is_not_a_path(path: Any) -> None:
    with pytest.raises(InvalidTypeError) as excinfo:
        speedflags.load_levers(path)
    assert str(excinfo.value) == (
        f"load_levers(path={path!r}): expected a str or os.PathLike path to a .json, .toml or "
        f".yaml file, got {type(path).__name__}"
    )
