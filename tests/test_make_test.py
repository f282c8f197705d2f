"""``make test`` runs its steps one after another and, when one fails, names those it did
not run (the benchmarks and examples it promises, which a failing suite used to skip without
a word).

The Makefile is run for real, by ``make``, in a virtual environment of its own whose Python
is a stand-in script: every step's command runs, instantly, and the stand-in fails the one
step a test asks it to. Nothing is installed (the environment's stamps are fresh) and
nothing is measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["torch-source", "lint", "typecheck", "unit", "examples", "benchmarks-once"]
# what each step's command has that the others' do not, as the stand-in Python sees it
MARKS = {
    "torch-source": ".ci/torch_source.py",
    "lint": "-m ruff",
    "typecheck": "-m mypy",
    "unit": "-p speedflags.pytest_plugin",
    "examples": "examples/",
    "benchmarks-once": "--benchmark-disable",
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_test(tmp_path: Path, failing: str | None) -> tuple[int, str, list[str]]:
    """``make test`` with a stand-in Python that fails the step ``failing``; its status,
    its stderr, and the steps whose commands ran, in order."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    fail = MARKS[failing] if failing else "never matches anything"
    stand_in = venv / "bin" / "python"
    lines = ["#!/bin/sh", f'echo "$*" >> "{log}"', f'case "$*" in *"{fail}"*) exit 1;; esac']
    stand_in.write_text("\n".join([*lines, "exit 0", ""]), encoding="utf-8")
    stand_in.chmod(0o755)
    for stamp in (".installed-torch-2.13.0", ".installed-extras-test-dev"):
        (venv / stamp).touch()  # newer than setup.cfg and pyproject.toml: nothing to install
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    done = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "test", f"PYTHON={sys.executable}",
         f"VENV={venv}", "TORCH_VERSION=2.13.0", "EXTRAS=test,dev"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    calls = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    ran = []
    for call in calls:
        step = next((s for s, mark in MARKS.items() if mark in call), None)
        if step is not None and step not in ran:
            ran.append(step)
    return done.returncode, done.stderr, ran


def test_a_failing_step_names_the_steps_it_did_not_run(tmp_path: Path) -> None:
    # Failed before: make stopped at the suite with "make: *** [Makefile: unit] Error 1",
    # and the examples and the benchmarks it promises never ran, with nothing said.
    status, err, ran = make_test(tmp_path, failing="unit")
    assert status != 0
    assert ran == ["torch-source", "lint", "typecheck", "unit"]
    assert "make test: the step 'unit' failed; not run: examples benchmarks-once" in err


def test_the_last_step_failing_says_nothing_was_left(tmp_path: Path) -> None:
    status, err, ran = make_test(tmp_path, failing="benchmarks-once")
    assert status != 0 and ran == STEPS
    assert "the step 'benchmarks-once' failed; not run: none (it was the last)" in err


def test_every_step_runs_in_order_when_all_pass(tmp_path: Path) -> None:
    status, err, ran = make_test(tmp_path, failing=None)
    assert status == 0, err
    assert ran == STEPS
    assert "failed" not in err
