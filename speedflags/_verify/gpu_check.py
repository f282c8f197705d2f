"""``make gpu-check``: everything a GPU machine should prove, in one command, into one folder.

Run as ``python -m speedflags._verify.gpu_check --out DIR`` (``make gpu-check GPU_OUT=DIR``)
from a source checkout. It needs only the Python it runs in, with torch (and pytest and
pytest-benchmark for the test steps): no network, no virtual environment. speedflags runs
from the checkout (``PYTHONPATH``); if that Python cannot import it from there, it is
installed with ``pip install --no-deps --no-build-isolation -e .`` (nothing else).

Steps, most valuable first, each a subprocess with its own log and a time cap, all within
``--budget`` seconds (a step that no longer fits is skipped and says so):

1. ``suite-1`` to ``suite-8``: the whole test suite with the GPU present, in eight processes
   of a share of its files each (on a GPU machine only; ``make unit`` runs it elsewhere),
   started at once and run beside ``gpu-tests``: none of them is timed;
2. ``gpu-tests``: the GPU-only tests (``tests/test_gpu_*.py``; they skip without a GPU);
3. ``verify``: ``python -m speedflags verify`` on the device, into ``verify.json`` (from here
   on, each step has the machine to itself);
4. ``verify-tf32-override``: the same for TF32 under ``NVIDIA_TF32_OVERRIDE=0`` (on a GPU it
   must report TF32 not in effect and exit 1);
5. ``bench``: ``python -m speedflags bench`` on the device (matmul to 8192, SDPA per kernel,
   conv with and without cuDNN benchmark, the train step), into ``bench.json``;
6. ``train-step``: ``benchmarks/train_step_interleaved.py`` on the device: fp32 eager,
   ``@speedup(amp="bf16")`` and the same compiled, timed round-robin;
7. ``overhead``: ``benchmarks/overhead_interleaved.py``: the enter+exit cost on this
   machine's CPU against plain torch;
8. ``benchmarks``: the pytest-benchmark suites once, untimed;

then ``summary.md``: device, driver, CUDA, PyTorch, every lever's verdict and speedup, and
TFLOP/s against the device's dense peak. Without a GPU the same steps run on the CPU, small,
and the check says no GPU was found and exits 0 when they pass.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["Step", "main", "plan"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the benchmarks as `make test` runs them (no leak check: the plain-torch overhead baseline
# writes flags on purpose)
BENCHMARKS = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "benchmarks", "--benchmark-disable"]
# The CPU suite took about 1,000 s in one process on the 16-core H200 machine (beside the GPU
# tests): in 8 processes of a share each it ends within the 300 s a step may take.
SUITE_SHARDS = 8
PYTEST = [
    "-m",
    "pytest",
    "-p",
    "speedflags.pytest_plugin",
    "--speedflags-leaks=fail",
    "-p",
    "no:cacheprovider",
    "-q",
]


@dataclass
class Step:
    """One subprocess of the check.

    Attributes:
        name: its name (and its log's, ``<name>.log``).
        argv: the Python arguments (after the interpreter).
        cap_s: the most seconds it may take.
        expect: the exit status that counts as passing.
        env: extra environment variables.
        why_skipped: set to skip it from the start (with this reason).
        alongside: start it at once and let the steps after it run beside it, until one
            that is ``quiet``.
        quiet: needs the machine to itself (it times something): every step running
            alongside is waited for first.
    """

    name: str
    argv: list[str]
    cap_s: float
    expect: int = 0
    env: dict[str, str] = field(default_factory=dict)
    why_skipped: str = ""
    alongside: bool = False
    quiet: bool = False


def plan(out: str, gpu: bool) -> list[Step]:
    """The steps for a machine with (``gpu``) or without a CUDA GPU.

    Example:
        >>> from speedflags._verify.gpu_check import plan
        >>> [s.name for s in plan("out", gpu=False)][-8:]  # doctest: +NORMALIZE_WHITESPACE
        ['suite-8', 'gpu-tests', 'verify', 'verify-tf32-override', 'bench', 'train-step',
         'overhead', 'benchmarks']
        >>> next(s for s in plan("out", gpu=True) if s.name == "verify-tf32-override").expect
        1
    """
    device = "cuda" if gpu else "cpu"
    gpu_tests = _test_files(gpu_only=True)
    verify = ["-m", "speedflags", "verify", "--device", device]
    bench = ["-m", "speedflags", "bench", "--device", device, "--json", f"{out}/bench.json"]
    train = ["benchmarks/train_step_interleaved.py", "--device", device, "--rounds", "30"]
    overhead = ["benchmarks/overhead_interleaved.py", "--rounds", "20", "--calls", "1000"]
    if not gpu:  # the same commands, small: the dry run proves the path, not the speed
        bench += ["--sizes", "96", "--passes", "1", "--min-time", "0.02"]
        train[-1] = "2"
        overhead[-3:] = ["2", "--calls", "100"]
    suite_skip = "" if gpu else "no GPU: `make unit` runs the CPU suite"
    suite = [
        Step(
            f"suite-{i + 1}",
            [*PYTEST, "-m", "not cuda", f"--junitxml={out}/suite-{i + 1}.xml", *files],
            300,
            env={"OMP_NUM_THREADS": "2"},
            why_skipped=suite_skip,
            alongside=True,
        )
        for i, files in enumerate(suite_shards())
    ]
    return [
        *suite,
        Step("gpu-tests", [*PYTEST, "-rs", f"--junitxml={out}/gpu-tests.xml", *gpu_tests], 300),
        Step("verify", [*verify, "--json", f"{out}/verify.json"], 90, quiet=True),
        Step(
            "verify-tf32-override",
            [*verify, "--levers", "tf32", "--json", f"{out}/verify-tf32-override.json"],
            60,
            expect=1 if gpu else 0,
            env={"NVIDIA_TF32_OVERRIDE": "0"},
        ),
        Step("bench", bench, 240),
        Step("train-step", train, 90),
        Step("overhead", overhead, 60),
        Step("benchmarks", [*BENCHMARKS, f"--junitxml={out}/benchmarks.xml"], 240),
    ]


def suite_shards(count: int = SUITE_SHARDS) -> list[list[str]]:
    """The CPU suite's files (``tests/test_*.py`` less the GPU ones) in ``count`` groups,
    dealt in turn: each group runs as a process of its own beside the others.

    Example:
        >>> from speedflags._verify.gpu_check import suite_shards
        >>> shards = suite_shards(3)
        >>> len(shards), "tests/test_gpu_kernels.py" in sum(shards, [])
        (3, False)
    """
    files = _test_files(gpu_only=False)
    return [files[i::count] for i in range(count)]


def _test_files(gpu_only: bool) -> list[str]:
    """``tests/test_gpu_*.py`` (``gpu_only``), or every other ``tests/test_*.py``, sorted."""
    return sorted(
        os.path.join("tests", name)
        for name in os.listdir(os.path.join(ROOT, "tests"))
        if name.startswith("test_")
        and name.endswith(".py")
        and name.startswith("test_gpu_") is gpu_only
    )


def _environment(gpu: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_found": gpu,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,  # type: ignore[no-untyped-call]
        "device": "cuda:0" if gpu else "cpu",
        "platform": platform.platform(),
    }
    if gpu:
        env["device_name"] = torch.cuda.get_device_name(0)
        env["compute_capability"] = list(torch.cuda.get_device_capability(0))
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit"
            done = subprocess.run(  # noqa: S603 - a fixed command line, no shell
                [smi, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            env["nvidia_smi"] = done.stdout.strip()
            env["driver"] = done.stdout.split(",")[1].strip() if "," in done.stdout else None
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi"] = f"failed: {exc}"
    return env


def _installed(python: str) -> bool:
    """Whether ``python`` has speedflags installed (its entry points: the pytest plugin)."""
    code = "import importlib.metadata as m; m.distribution('speedflags')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run(  # noqa: S603 - the interpreter running this check
            [python, "-c", code], capture_output=True, timeout=120, env=env, cwd=os.sep
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(extra)
    return env


@dataclass
class _Launched:
    """A step's process, started; :meth:`finish` waits for it within its cap."""

    step: Step
    record: dict[str, Any]
    process: subprocess.Popen[bytes]
    log: IO[str]
    cap: float
    started: float

    def finish(self) -> dict[str, Any]:
        left = self.cap - (time.perf_counter() - self.started)
        try:
            rc: int | None = self.process.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            rc = None
        self.log.close()
        record, expect = self.record, self.step.expect
        record["seconds"] = round(time.perf_counter() - self.started, 1)
        record["rc"] = rc
        if rc is None:
            record["status"] = f"TIMED OUT after {self.cap:.0f} s"
        elif rc == expect:
            record["status"] = "passed" if rc == 0 else f"passed (exit {rc}, as expected)"
        else:
            record["status"] = f"FAILED (exit {rc}, expected {expect})"
        return record


def _launch(step: Step, out: str, python: str, left: float) -> _Launched | dict[str, Any]:
    """Start ``step``; or, when it is not to run, its record saying why."""
    log = os.path.join(out, f"{step.name}.log")
    record: dict[str, Any] = {"name": step.name, "log": os.path.basename(log), "seconds": 0.0}
    if step.why_skipped:
        record["status"] = f"skipped: {step.why_skipped}"
        return record
    cap = min(step.cap_s, left)
    if cap < 15:
        record["status"] = "skipped: out of time"
        return record
    command = [python, *step.argv]
    fh = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed by _Launched.finish
    fh.write("$ " + " ".join(command) + "\n\n")
    fh.flush()
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
        command, stdout=fh, stderr=subprocess.STDOUT, env=_env(step.env), cwd=ROOT
    )
    return _Launched(step, record, process, fh, cap, time.perf_counter())


def _run(step: Step, out: str, python: str, left: float) -> dict[str, Any]:
    """Run ``step`` to its end (or its cap); its record."""
    launched = _launch(step, out, python, left)
    return launched.finish() if isinstance(launched, _Launched) else launched


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return 0 when every step that ran passed."""
    parser = argparse.ArgumentParser(prog="python -m speedflags._verify.gpu_check")
    parser.add_argument("--out", required=True, help="the folder everything is written to")
    parser.add_argument("--budget", type=float, default=530.0, help="seconds for all steps (530)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    import torch

    gpu = bool(torch.cuda.is_available())
    print(
        "speedflags gpu-check: "
        + (
            f"GPU found: {torch.cuda.get_device_name(0)}"
            if gpu
            else "no GPU found (torch.cuda.is_available() is False): running the CPU parts only"
        ),
        flush=True,
    )
    env = _environment(gpu)
    python = sys.executable
    if not _installed(python):
        env["install"] = _install(python, out)
    with open(os.path.join(out, "environment.json"), "w", encoding="utf-8") as fh:
        json.dump(env, fh, indent=2, default=str)
    records: dict[str, dict[str, Any]] = {}
    beside: list[_Launched] = []

    def done(record: dict[str, Any]) -> None:
        records[record["name"]] = record
        print(f"  {record['name']}: {record['status']} ({record['seconds']:.0f} s)", flush=True)
        with open(os.path.join(out, "steps.json"), "w", encoding="utf-8") as fh:
            json.dump({"steps": list(records.values())}, fh, indent=2)

    steps = plan(out, gpu)
    for step in steps:
        if step.quiet:
            while beside:
                done(beside.pop(0).finish())
        left = args.budget - (time.perf_counter() - started)
        launched = _launch(step, out, python, left)
        if not isinstance(launched, _Launched):
            done(launched)
        elif step.alongside:
            records[step.name] = {"name": step.name, "status": "running"}
            beside.append(launched)
        else:
            done(launched.finish())
    while beside:
        done(beside.pop(0).finish())
    records = {s.name: records[s.name] for s in steps}  # the plan's order in steps.json
    with open(os.path.join(out, "steps.json"), "w", encoding="utf-8") as fh:
        json.dump({"steps": list(records.values())}, fh, indent=2)
    from .summary import render

    text = render(out)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    print(text)
    elapsed = time.perf_counter() - started
    failed = [n for n, r in records.items() if r["status"].startswith(("FAILED", "TIMED OUT"))]
    verdict = f"failed: {', '.join(failed)}" if failed else "every step that ran passed"
    where = "" if gpu else " (no GPU found: CPU parts only)"
    print(f"speedflags gpu-check: {verdict}{where}; {elapsed:.0f} s; everything is in {out}")
    return 1 if failed else 0


def _install(python: str, out: str) -> str:
    """``pip install --no-deps --no-build-isolation -e .``; what happened, in words."""
    command = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", ROOT]
    with open(os.path.join(out, "install.log"), "w", encoding="utf-8") as fh:
        try:
            done = subprocess.run(  # noqa: S603 - our own interpreter, fixed arguments
                command, stdout=fh, stderr=subprocess.STDOUT, timeout=300, cwd=ROOT
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"pip install failed ({exc}); running from PYTHONPATH"
    if done.returncode:
        return f"pip install exited {done.returncode} (install.log); running from PYTHONPATH"
    return "installed with pip install --no-deps --no-build-isolation -e ."


if __name__ == "__main__":
    sys.exit(main())
