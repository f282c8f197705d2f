"""The command lines' options, checked in one place (``speedflags._cli.options``) before any
work: empty values, output files that cannot be written, a lever ``tune`` never tries, a
mixed TF32 state, bounds. Each refusal is one line naming the option, exit status 2, and
comes before a user's file is imported or anything is measured; a full disk, found only
when the file is written, is one line and exit status 2 too, after the work.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import needs_new_api

import speedflags._measure.verdicts  # noqa: F401 - imported before a test runs as another user
from speedflags.__main__ import main
from speedflags._measure.output_paths import check_output
from speedflags.errors import InvalidValueError

TINY = ["--device", "cpu", "--sizes", "16", "--passes", "1", "--rounds", "1", "--min-time", "0"]
STEPS = """
import pathlib
import torch

pathlib.Path(__file__).with_name("imported").write_text("the file was imported")

def step():
    return torch.sin, (torch.ones(8),)
"""
MEASURED = "speedflags verify on"  # the first line of verify's table


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(STEPS))
    return path


def one_line_naming(err: str, option: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]  # no traceback, no progress: nothing was measured
    assert option in lines[0], lines[0]
    return lines[0]


# --- empty values (group 4) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("bench", "--sizes"),
        ("bench", "--json"),
        ("bench", "--plot"),
        ("bench", "--workload"),
        ("bench", "--device"),
        ("bench", "--config"),
        ("tune", "--out"),
        ("tune", "--plot"),
        ("tune", "--levers"),
        ("tune", "--device"),
        ("verify", "--json"),
        ("verify", "--levers"),
        ("verify", "--device"),
        ("report", "--device"),
    ],
)
def test_an_empty_value_is_a_usage_error_naming_the_option(
    command: str, option: str, steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: bench --sizes "" ran the default sizes; bench --json "" and tune --out ""
    # wrote nothing and exited 0; others took "" for "not given" or failed later.
    args = [command, f"{steps}:step"] if command == "tune" else [command]
    assert main([*args, option, ""]) == 2
    line = one_line_naming(capsys.readouterr().err, f"{option} ''")
    assert line.startswith(f"speedflags {command}: {option} '': empty")
    assert not (steps.parent / "imported").exists()


def test_an_empty_compare_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--compare", "", "b.json"]) == 2
    one_line_naming(capsys.readouterr().err, "--compare ''")


# --- output files that cannot be written (group 3) ------------------------------------------


@pytest.fixture
def under_a_file(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker / "out.json"


def test_verify_refuses_a_json_path_under_a_file_before_measuring(
    under_a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: verify ran every probe, then died in save() with a traceback, status 1
    assert main(["verify", "--device", "cpu", "--levers", "tf32", "--json", str(under_a_file)]) == 2
    captured = capsys.readouterr()
    assert MEASURED not in captured.out
    line = one_line_naming(captured.err, "--json")
    assert "is a file, so no folder can be made under it" in line


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """Run as the user ``nobody`` (effective uid), if this is root: root writes anywhere,
    and os.access() answers for the real user, so only a real try tells the difference."""
    if os.name != "posix" or os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def read_only_folder() -> Iterator[Path]:
    # in /tmp, not in pytest's tmp_path: another user must be able to reach it
    top = Path(tempfile.mkdtemp(prefix="speedflags-ro-"))
    top.chmod(0o755)
    folder = top / "read-only"
    folder.mkdir(mode=0o555)
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)
    folder.rmdir()
    top.rmdir()


@pytest.mark.skipif(os.name != "posix", reason="permission bits and users are POSIX's")
@pytest.mark.parametrize("name", ["verdicts.json", "new/verdicts.json"])
def test_verify_refuses_a_folder_this_user_cannot_write(
    read_only_folder: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: verify asked os.access(), which answers for the real user (root here)
    path = read_only_folder / name
    with unprivileged():
        code = main(["verify", "--device", "cpu", "--levers", "tf32", "--json", str(path)])
    assert code == 2
    captured = capsys.readouterr()
    assert MEASURED not in captured.out
    line = one_line_naming(captured.err, "--json")
    assert "Permission denied" in line
    assert list(read_only_folder.iterdir()) == []


def test_the_check_makes_nothing_it_leaves_behind(tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "out.json"
    check_output(str(path), "--json")
    assert list(tmp_path.iterdir()) == []  # the folders it made to try were removed
    existing = tmp_path / "kept.json"
    existing.write_text("{}")
    check_output(str(existing), "--json")
    assert existing.read_text() == "{}"  # opened for appending, not truncated
    with pytest.raises(InvalidValueError, match="cannot create files in"):
        check_output(str(tmp_path / ("x" * 300 + ".json")), "--json")  # a name too long


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["verify", "bench", "tune"])
def test_a_full_disk_found_only_when_written_is_one_line_and_status_2(
    command: str, steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /dev/full opens for writing (the check passes) and refuses every write, as a full disk
    # does. Failed before for verify: a traceback from save(), status 1.
    args = {
        "verify": ["verify", "--device", "cpu", "--levers", "tf32", "--json", "/dev/full"],
        "bench": ["bench", "--workload", "matmul", *TINY, "--json", "/dev/full"],
        "tune": ["tune", f"{steps}:step", "--levers", "tf32", "--device", "cpu",
                 "--out", "/dev/full.json"],
    }[command]  # fmt: skip
    if command == "tune":  # tune's file must be .json, .toml or .yaml: a link to /dev/full
        (steps.parent / "full.json").symlink_to("/dev/full")
        args[-1] = str(steps.parent / "full.json")
    assert main(args) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    option = "--out" if command == "tune" else "--json"
    assert last.startswith(f"speedflags {command}: {option} ")
    assert last.endswith("could not be written: No space left on device"), err[-2000:]
    assert "Traceback" not in err


# --- tune --levers deterministic (group 5) --------------------------------------------------


def test_tune_refuses_a_lever_it_never_tries_before_importing_the_file(
    steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: the file was imported (its side effects ran) and the message named
    # tune(levers=...), not the option the user typed.
    assert main(["tune", f"{steps}:step", "--levers", "deterministic"]) == 2
    line = one_line_naming(capsys.readouterr().err, "--levers 'deterministic'")
    assert "tune never tries deterministic" in line and "tune(levers=" not in line.split(";")[0]
    assert not (steps.parent / "imported").exists()
    assert main(["tune", f"{steps}:step", "--levers", "tf32,deterministic"]) == 2
    one_line_naming(capsys.readouterr().err, "--levers 'tf32,deterministic'")
    assert not (steps.parent / "imported").exists()


# --- a mixed TF32 state (group 6) ------------------------------------------------------------


@needs_new_api
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_refuse_a_mixed_tf32_state_before_any_work(
    command: str, raw_tf32: None, steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before (bench): the problems were prepared, then MixedTF32APIError's traceback
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the legacy getter says 'highest'
    args: list[str] = {
        "bench": ["bench", "--workload", "matmul", *TINY],
        "tune": ["tune", f"{steps}:step", "--levers", "tf32", "--device", "cpu"],
    }[command]
    assert main(args) == 2
    line = one_line_naming(capsys.readouterr().err, f"speedflags {command}: ")
    assert "the TF32 state of this process is mixed" in line
    assert "heal_tf32()" in line and "Nothing was measured" in line
    assert not (steps.parent / "imported").exists()


# --- bounds (group 9) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [("--rounds", "1000000000000", "1 to 1000"), ("--passes", "101", "1 to 100")],
)
def test_bench_bounds_its_counts_and_says_the_bound(
    option: str, value: str, bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: --rounds 1000000000000 was accepted (a run that never ends)
    args = ["bench", "--workload", "matmul", "--device", "cpu", option, value]
    assert main(args) == 2
    line = one_line_naming(capsys.readouterr().err, f"{option} {value}")
    assert line.endswith(f"must be from {bound}")


# --- what argparse itself refuses is one line too -----------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["bench", "--passes", "x"], "--passes"),
        (["bench", "--compare", "only-one.json"], "--compare"),
        (["bench", "--bogus"], "--bogus"),
        (["verify", "--levers"], "--levers"),
        (["tune"], "FILE.py:FACTORY"),
        (["nothing-such"], "'nothing-such'"),
    ],
)
def test_an_option_argparse_refuses_is_one_line_not_the_usage_block(
    args: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: argparse printed its usage block (five lines or more) above the reason.
    assert main(args) == 2
    line = one_line_naming(capsys.readouterr().err, option)
    assert line.startswith("speedflags") and "usage:" not in line
    assert line.endswith("--help)")


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: speedflags tune")
