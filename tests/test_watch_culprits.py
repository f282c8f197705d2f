"""Errors and reports name who wrote a flag: MixedTF32APIError, DriftWarning,
tf32_status() and the "last written by" column of speedflags report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from _watch_helpers import enable_tf32, first_line, load_library, undo, unwatched  # noqa: F401
from conftest import HAS_NEW_API

import speedflags
from speedflags import DriftWarning, MixedTF32APIError, fast_math
from speedflags._watch.writers import last_writers
from speedflags.report import build_report, render_report

HERE = os.path.abspath(__file__)


def benchmark_attribute() -> None:
    torch.backends.cudnn.benchmark = True


def generic_node() -> None:
    torch.backends.fp32_precision = "tf32"


# --- errors and reports name the culprit -------------------------------------------------


@pytest.mark.skipif(not HAS_NEW_API, reason="a legacy-only PyTorch cannot be mixed")
def test_mixed_tf32_error_names_the_writer() -> None:
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    writer = enable_tf32()
    with speedflags.watch():
        writer(True)
        with pytest.raises(MixedTF32APIError) as excinfo, fast_math(tf32=True):
            pass
        status = speedflags.tf32_status()
    message = str(excinfo.value)
    assert "Last written by: torch.backends.fp32_precision set to 'tf32' by enable_tf32 at " in (
        message
    )
    assert f"{import_utils.__file__}:" in message
    assert status.last_written_by is not None
    assert status.last_written_by.startswith("torch.backends.fp32_precision set to 'tf32' by")
    assert status.to_dict()["last_written_by"] == status.last_written_by
    assert f"made mixed by: {status.last_written_by}" in status.notes


@pytest.mark.skipif(not HAS_NEW_API, reason="a legacy-only PyTorch cannot be mixed")
@pytest.mark.usefixtures("unwatched")
def test_mixed_tf32_error_says_how_to_find_the_writer_when_not_watching() -> None:
    generic_node()
    with pytest.raises(MixedTF32APIError, match=r"speedflags\.watch\(\)"), fast_math(tf32=True):
        pass


def test_drift_warning_names_the_writer() -> None:
    with speedflags.watch(), pytest.warns(DriftWarning) as caught:
        with fast_math(cudnn_benchmark=True):
            torch.backends.cudnn.benchmark = False
            line = sys._getframe().f_lineno - 1
    message = str(caught[0].message)
    assert f"torch.backends.cudnn.benchmark set to False by {sys._getframe().f_code.co_name}" in (
        message
    )
    assert f"{HERE}:{line}" in message


@pytest.mark.usefixtures("unwatched")
def test_a_last_writer_is_forgotten_once_the_state_changes_unseen(tmp_path: Path) -> None:
    library = load_library(tmp_path)
    with speedflags.watch():
        library.configure()
        assert "by configure at" in (speedflags.tf32_status().last_written_by or "")
    torch.set_float32_matmul_precision("highest")  # not watching now
    assert speedflags.tf32_status().last_written_by is None


def test_report_has_a_last_written_by_column(tmp_path: Path) -> None:
    library = load_library(tmp_path)
    with speedflags.watch():
        library.configure()
        benchmark_attribute()
        report = build_report("cpu")
    writers = report["last_written_by"]
    assert writers["cudnn_benchmark"].endswith(f"by benchmark_attribute at {HERE}:"
                                               f"{first_line(benchmark_attribute)}")  # fmt: skip
    assert writers["matmul_precision.torch.get_float32_matmul_precision()"].startswith(
        "torch.set_float32_matmul_precision('high') by configure at "
    )
    text = render_report(report)
    assert "last written by" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("cudnn_benchmark ="))
    assert f"by benchmark_attribute at {HERE}:" in line


@pytest.mark.usefixtures("unwatched")
def test_writers_seen_before_a_gap_in_watching_are_forgotten() -> None:
    with speedflags.watch():
        benchmark_attribute()
        assert "cudnn_benchmark" in last_writers()
    torch.backends.cudnn.benchmark = False  # unseen: nothing watches
    torch.backends.cudnn.benchmark = True  # unseen, and the same state as before
    with speedflags.watch():
        assert "cudnn_benchmark" not in last_writers()
