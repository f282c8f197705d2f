"""Every example runs with ``--smoke`` (as ``make examples`` runs them), prints its speedup
against fp32 (or says in words why there is none to show) and leaves every flag as it found
it (each checks with speedflags.snapshot()); with ``--levers cudnn_benchmark=true``, which
changes nothing on any CPU, each says so instead of crediting the lever with a figure.

Each runs in its own process, with this checkout first on ``PYTHONPATH``. The integration
examples are skipped where their library is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ZEN3

import speedflags

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
    "lightning_yaml/train.py": None if HAS_LIGHTNING else "pip install '.[lightning]'",
    "hf_trainer.py": None
    if installed("transformers", "accelerate")
    else "pip install '.[transformers]'",
}


def _launch(tmp_path_factory: pytest.TempPathFactory, *args: str) -> dict[str, Any]:
    """Every runnable example, started at once with ``args``: they import torch and their
    trainers, which is most of their time, in parallel. Each test then waits for its own."""
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
                    [sys.executable, str(EXAMPLES / script), *args],
                    cwd=cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                cwd,
            )
    return processes


def _stop(processes: dict[str, Any]) -> None:
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    processes = _launch(tmp_path_factory, "--smoke")
    yield processes
    _stop(processes)


@pytest.fixture(scope="module")
def launched_no_effect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # started when its first test runs, after the plain --smoke runs: four at a time
    processes = _launch(tmp_path_factory, "--smoke", "--levers", "cudnn_benchmark=true")
    yield processes
    _stop(processes)


def _finished(script: str, launched: dict[str, Any]) -> str:
    if SCRIPTS[script] is not None:
        pytest.skip(f"needs {SCRIPTS[script]}")
    process, cwd = launched[script]
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert "flags as found at the start: yes" in output
    assert not list(cwd.iterdir()), "the example left files in its working directory"
    return str(output)


def _result_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if "speedup vs fp32: " in line]
    return line


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_example_runs_with_smoke(script: str, launched: dict[str, Any]) -> None:
    line = _result_line(_finished(script, launched))
    said = line.split("speedup vs fp32: ", 1)[1]
    # a figure with its noise, or words: never a bare figure
    figure = re.fullmatch(r"\d+\.\d\dx \(±\d+%, 3 interleaved passes\).*", said)
    assert figure or said.startswith("none shown: "), line


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_lever_without_effect_gets_words_not_a_speedup(
    script: str, launched_no_effect: dict[str, Any]
) -> None:
    # Failed before: cifar10_resnet.py --smoke credited cudnn_benchmark=True with 5.15x on a
    # CPU, where it changes nothing (the fp32 run went first and paid the one-time costs).
    # cuDNN's autotuning has no effect on any CPU: the example says so, with no figure.
    line = _result_line(_finished(script, launched_no_effect))
    assert "speedflags (cudnn_benchmark=True)" in line
    said = line.split("speedup vs fp32: ", 1)[1]
    assert said.startswith("none shown: no lever has an effect on cpu, so both runs did the same")
    assert "cudnn_benchmark=True: no effect on cpu: cuDNN autotuning is for CUDA" in said
    assert not re.search(r"\d\.\d\dx", said)  # no speedup figure anywhere in it


class VirtualClock:
    """Virtual seconds: each step adds what it costs (no timing is measured or asserted)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, VirtualClock]:
    """The examples' ``_common``, timing on a virtual clock."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _common

    clock = VirtualClock()
    monkeypatch.setattr(_common, "clock", clock)
    return _common, clock


def test_long_runs_say_how_long_they_take_and_where_they_are(
    timed: tuple[Any, VirtualClock],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _common, clock = timed
    monkeypatch.setattr(_common, "PROGRESS_EVERY_S", 0.0)  # a line at every step
    losses = iter([9.0, 3.0, 2.0, 1.0])

    def step() -> torch.Tensor:
        clock.now += 1.0
        return torch.tensor(next(losses))

    mean = _common.seconds_per_step(step, 3, torch.device("cpu"), "fp32", runs=2)
    assert mean == pytest.approx(1.0)  # the 3 timed steps, not the warm-up step
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fp32: warm-up step 1.0 s (one-time costs), then 1.0 s a step")
    assert "about 2.0 s for the 2 steps left; about 6.0 s for all 2 runs" in lines[0]
    # the last step prints nothing: the speedup line follows it
    assert [line.split(",")[:2] for line in lines[1:]] == [
        ["fp32: step 1/3", " loss 3.0000"],
        ["fp32: step 2/3", " loss 2.0000"],
    ]
    assert all("elapsed, about" in line and line.endswith(" left") for line in lines[1:])


def test_the_estimate_comes_from_a_timed_step_not_the_warm_up(
    timed: tuple[Any, VirtualClock], capsys: pytest.CaptureFixture[str]
) -> None:
    # Failed before: the estimate was the warm-up step's time (one-time costs included) times
    # every step of every run: "about 51.0 s for the 6 runs" for a run that took 15.6 s. Here
    # the warm-up step costs 10 virtual seconds, every other step 1: two runs of 3 steps
    # take 2 more seconds in this one and 4 in the next, as said.
    _common, clock = timed
    costs = iter([10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def step() -> None:
        clock.now += next(costs)

    _common.seconds_per_step(step, 3, torch.device("cpu"), "fp32", runs=2)
    said = capsys.readouterr().out
    began = clock.now
    _common.seconds_per_step(step, 3, torch.device("cpu"), "fp32", runs=1)  # the next run
    assert "about 6.0 s for all 2 runs" in said
    assert 2.0 + (clock.now - began) == 6.0  # what the rest of the two runs took


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _common

    return _common


CPU = torch.device("cpu")
# per-pass seconds per step, as interleaved() returns them (made up: no timing is asserted)
CLEAR = {"fp32": [0.20, 0.30, 0.21], "speedflags": [0.10, 0.15, 0.105]}  # 2x in every pass
NOISY = {"fp32": [0.20, 0.30, 0.21], "speedflags": [0.25, 0.20, 0.22]}  # 1.05x, ±15 %


def test_the_speedup_line_says_its_noise_or_gives_words(common: Any) -> None:
    line = common.speedup_line("demo", CLEAR, {"matmul_precision": "medium"}, CPU)
    if common.verdicts_here({"matmul_precision": "medium"}, CPU)[0].status == "no effect here":
        assert "none shown: no lever has an effect on cpu" in line  # AVX2, or PyTorch 2.1
    else:
        assert line.endswith("speedup vs fp32: 2.00x (±0%, 3 interleaved passes)")
    # a step that is not faster beyond the noise says so
    line = common.speedup_line("demo", NOISY, {"sdpa": "flash"}, CPU)  # in effect on any CPU
    assert "speedup vs fp32: none shown: within the noise (1.05x, ±" in line
    # no levers (nothing recommended), or fp32's own: no figure at all
    line = common.speedup_line("demo", CLEAR, {}, CPU)
    assert line.endswith("none shown: no lever to apply: speedflags.recommended('cpu') is empty, "
                         "none is faster here")  # fmt: skip
    line = common.speedup_line("demo", CLEAR, {"tf32": False, "amp": False}, CPU)
    assert line.endswith("none shown: these levers are fp32's own, so both runs did the same work")
    line = common.speedup_line("demo", CLEAR, {"tf32": True, "cudnn_benchmark": True}, CPU)
    assert "none shown: no lever has an effect on cpu" in line and "2.00x" not in line


def test_the_speedup_printed_is_the_ratio_of_the_times_printed_beside_it(common: Any) -> None:
    # Failed before: the times were medians of the passes, the speedup the geometric mean of
    # the per-pass ratios: "fp32 23.94 ms/step; speedflags 32.82 ms/step ... (1.82x, ±77%)".
    # Passes that disagree that much (made up: no timing is asserted), with sdpa="flash",
    # which is in effect on any CPU.
    times = {"fp32": [0.024, 0.090, 0.020], "speedflags": [0.033, 0.012, 0.040]}
    line = common.speedup_line("demo", times, {"sdpa": "flash"}, CPU)
    fp32, fast = (float(ms) for ms in re.findall(r"([\d.]+) ms/step", line))
    (speedup,) = re.findall(r"\(([\d.]+)x, ±", line) or re.findall(r"([\d.]+)x \(±", line)
    assert float(speedup) == pytest.approx(fp32 / fast, abs=0.01), line


def test_an_emulated_lever_is_named_beside_its_figure(
    common: Any, fake_cpu: Callable[..., None]
) -> None:
    fake_cpu(ZEN3)  # no bf16 instructions (faked where this CPU has them)
    slow = {"fp32": [0.10, 0.12, 0.11], "speedflags": [2.0, 2.4, 2.2]}
    line = common.speedup_line("demo", slow, {"amp": "bf16"}, CPU)
    assert "speedup vs fp32: 0.05x (±0%, 3 interleaved passes)" in line
    assert line.endswith("(in effect, emulated: slower here: amp='bf16')")


def test_fewer_than_three_passes_are_refused(common: Any) -> None:
    with pytest.raises(SystemExit, match="at least 3"):
        common.passes(2, smoke=False)
    assert common.passes(None, smoke=True) == 3 and common.passes(None, smoke=False) == 5


# The README's `tune` example, word for word, run from the repository's root (here: a folder
# whose `examples` is the repository's, so that its files land in a temporary folder).
README_TUNE = (
    "python -m speedflags tune examples/steps.py:make_step --budget 0.01 --seconds 120 "
    "--out levers.json"
)
# ...and the same with a plot, as docs/tune.md shows it
TUNE_PAGE = README_TUNE + " --plot pareto.png"


def test_the_readme_and_the_tune_page_show_the_tested_commands() -> None:
    assert README_TUNE in (ROOT / "README.md").read_text(encoding="utf-8")
    assert TUNE_PAGE in (ROOT / "docs" / "tune.md").read_text(encoding="utf-8")


@pytest.mark.skipif(not installed("matplotlib"), reason="--plot needs pip install '.[plot]'")
def test_the_readme_tune_command_runs_on_the_step_the_repository_ships(tmp_path: Path) -> None:
    # Failed before: the README ran `steps.py:make_step`, which the repository did not have.
    # The run is bounded by its own --seconds; what it chooses is not asserted (it measures).
    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = TUNE_PAGE.split()
    assert command[:3] == ["python", "-m", "speedflags"]
    done = subprocess.run(
        [sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "best: " in done.stdout and "tune: reference: plain fp32" in done.stderr
    levers = speedflags.load_levers(tmp_path / "levers.json")
    assert isinstance(levers, dict)
    assert (tmp_path / "pareto.png").stat().st_size > 0
