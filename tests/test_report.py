"""python -m speedflags report: in process, and once as a real subprocess and console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import needs_new_api

import speedflags
from speedflags.__main__ import main
from speedflags.report import _flatten


def test_report_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"speedflags {speedflags.__version__}" in out
    assert "device: cpu" in out
    assert "TF32 API:" in out
    assert "consistent: True" in out
    assert "torch.backends.cuda.matmul.allow_tf32 = False" in out
    assert "recommended for cpu" in out
    assert "--apply" not in out


def test_report_apply_restore_proves_the_state_came_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = speedflags.snapshot()
    assert main(["report", "--apply", "--restore", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["restore"]["exact"] is True
    flat: dict[str, Any] = {}
    _flatten("", before, flat)
    assert report["restore"]["getters_compared"] == len(flat) >= 10  # fewer on PyTorch < 2.9
    assert report["restore"]["mismatches"] == []
    expected = speedflags.recommended("cpu").levers
    assert set(report["apply"]["levers"]) == set(expected)
    if expected:
        assert report["apply"]["changes"]  # something visibly changed inside
        assert {r["action"] for r in report["apply"]["records"]} == {"set"}
    assert speedflags.snapshot() == before


def test_report_apply_without_restore_leaves_the_frame_open(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = speedflags.snapshot()
    assert main(["report", "--apply", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "restore" not in report
    open_frames = speedflags.ledger().open_frames()
    assert [f.label for f in open_frames] == ["speedflags report --apply"]
    speedflags.ledger().close(open_frames[0])  # what the end of the process would make moot
    assert speedflags.snapshot() == before


@needs_new_api
def test_report_shows_a_mixed_state(raw_tf32: None, capsys: pytest.CaptureFixture[str]) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert main(["report", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "consistent: False" in out
    assert "conflict: torch.backends.cuda.matmul.fp32_precision is 'tf32'" in out
    assert "<raises RuntimeError" in out


def test_restore_without_apply_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--restore"]) == 2
    assert "speedflags report: --restore proves" in capsys.readouterr().err


def test_bad_device_is_reported_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--device", "gpu"]) == 2
    assert "speedflags report: --device 'gpu': not a device" in capsys.readouterr().err


def run_cli(*command: str) -> Any:
    return subprocess.run(
        list(command), capture_output=True, text=True, timeout=120, env={**os.environ}
    )


def test_python_dash_m_smoke() -> None:
    result = run_cli(sys.executable, "-m", "speedflags", "report", "--apply", "--restore", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["restore"]["exact"] is True


def test_console_script_is_installed() -> None:
    script = shutil.which("speedflags", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("speedflags is not installed as a package here (no console script)")
    result = run_cli(script, "report", "--help")
    assert result.returncode == 0
    assert "--apply" in result.stdout


def test_report_lists_the_pytorch_features_it_found(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "ranks" not in report  # no process group: no section about ranks
    features = report["features"]
    assert features["fp32_precision API"]["present"] is hasattr(torch.backends, "fp32_precision")
    has_order = hasattr(torch._C, "_get_sdp_priority_order")
    assert features["SDPA priority order"]["present"] is has_order
    if not has_order:  # PyTorch 2.4: says what speedflags does without it
        assert "cannot put them first" in features["SDPA priority order"]["note"]
    assert features["SDPA backends"]["note"].startswith("flash, efficient")


def test_report_says_what_each_lever_does_here_in_the_shared_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from speedflags._measure.lever_files import plain_value
    from speedflags._measure.route import effect_here
    from speedflags._measure.vocabulary import status_of
    from speedflags.levers.registry import REGISTRY

    assert main(["report", "--device", "cpu", "--json"]) == 0
    found = {v["label"]: v for v in json.loads(capsys.readouterr().out)["lever_verdicts"]}
    expected = {}
    for spec in REGISTRY:
        for raw in spec.candidates:
            value = spec.validate(raw)
            effect = effect_here(spec.name, value, torch.device("cpu"))
            expected[f"{spec.name}={plain_value(spec.name, value)!r}"] = status_of(effect)
    assert {label: v["status"] for label, v in found.items()} == expected
    bf16 = speedflags.capabilities("cpu").bf16
    # never "no effect here" for an emulated dtype (the words of verify, bench and tune)
    assert found["amp='bf16'"]["status"] == ("in effect" if bf16 else "in effect, emulated: slower")
    assert found["tf32=True"]["status"] == "no effect here"
    assert main(["report", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "what each lever does on cpu (`speedflags verify` measures it)" in text
    line = next(line for line in text.splitlines() if line.strip().startswith("amp='bf16'"))
    assert found["amp='bf16'"]["status"] in line


def test_the_last_written_by_column_shows_from_the_command_line_under_a_watch() -> None:
    # Failed before: the column showed only for values written while a watch ran, and from
    # the command line nothing writes one, so SPEEDFLAGS_WATCH=1 never showed it.
    env = {**os.environ, "SPEEDFLAGS_WATCH": "1"}
    shown = subprocess.run(
        [sys.executable, "-m", "speedflags", "report", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    ).stdout.splitlines()  # fmt: skip
    heading = next(line for line in shown if line.startswith("levers and guarded settings"))
    assert "last written by (speedflags.watch(); -: not written since it started)" in heading
    benchmark = next(line for line in shown if line.strip().startswith("cudnn_benchmark ="))
    assert benchmark.rstrip().endswith(" -")
    env.pop("SPEEDFLAGS_WATCH")
    unwatched = subprocess.run(
        [sys.executable, "-m", "speedflags", "report", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    ).stdout  # fmt: skip
    assert "last written by" not in unwatched
