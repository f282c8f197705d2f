"""Every example runs with ``--smoke`` (as ``make examples`` runs them), prints its speedup
against fp32 and leaves every flag as it found it (each checks with speedflags.snapshot()).

Each runs in its own process, with this checkout first on ``PYTHONPATH``. The integration
examples are skipped where their library is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


HAS_LIGHTNING = installed("jsonargparse") and (
    installed("lightning") or installed("pytorch_lightning")
)
# script -> why it cannot run here (None: it can)
SCRIPTS: dict[str, str | None] = {
    "train_toy_transformer.py": None,
    "cifar10_resnet.py": None,
    "lightning_yaml/train.py": None if HAS_LIGHTNING else "pip install 'speedflags[lightning]'",
    "hf_trainer.py": None
    if installed("transformers", "accelerate")
    else "pip install 'speedflags[transformers]'",
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every runnable example, started at once: they import torch and their trainers, which
    is most of their time, in parallel. Each test then waits for its own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    processes = {}
    for script, missing in SCRIPTS.items():
        if missing is None:
            cwd = tmp_path_factory.mktemp("example")
            processes[script] = (
                subprocess.Popen(
                    [sys.executable, str(EXAMPLES / script), "--smoke"],
                    cwd=cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                cwd,
            )
    yield processes
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_example_runs_with_smoke(script: str, launched: dict[str, Any]) -> None:
    if SCRIPTS[script] is not None:
        pytest.skip(f"needs {SCRIPTS[script]}")
    process, cwd = launched[script]
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert "speedup vs fp32:" in output
    assert "flags as found at the start: yes" in output
    assert not list(cwd.iterdir()), "the example left files in its working directory"


def test_long_runs_say_how_long_they_take_and_where_they_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _common

    monkeypatch.setattr(_common, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    losses = iter([9.0, 3.0, 2.0, 1.0])
    started = time.perf_counter()
    mean = _common.seconds_per_step(
        lambda: torch.tensor(next(losses)), 3, torch.device("cpu"), "fp32", runs=2
    )
    elapsed = time.perf_counter() - started
    lines = capsys.readouterr().out.splitlines()
    # the mean of the 3 timed steps (the warm-up step is not counted): 3 of them fit in the
    # whole call, a total returned as the mean would not
    assert 0 < 3 * mean <= elapsed
    assert lines[0].startswith("fp32: first step took ")
    assert "3 more steps: about" in lines[0] and "for the 2 runs" in lines[0]
    # the last step prints nothing: the speedup line follows it
    assert [line.split(",")[:2] for line in lines[1:]] == [
        ["fp32: step 1/3", " loss 3.0000"],
        ["fp32: step 2/3", " loss 2.0000"],
    ]
    assert all("elapsed, about" in line and line.endswith(" left") for line in lines[1:])
