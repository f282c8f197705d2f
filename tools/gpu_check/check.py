"""``make gpu-check``: everything a GPU machine should prove, in one command, into one folder.

Run as ``python -m tools.gpu_check --out DIR`` (``make gpu-check GPU_OUT=DIR``)
from a source checkout. It needs only the Python it runs in, with torch (and pytest and
pytest-benchmark for the test steps): no network, no virtual environment. speedflags runs
from the checkout (``PYTHONPATH``); if that Python cannot import it from there, it is
installed with ``pip install --no-deps --no-build-isolation -e .`` (nothing else).

Its steps (:mod:`.steps`: the CPU suite beside the GPU tests, ``verify`` with and
without TF32 overridden, the FP8 headroom, the train step, the frame overhead, ``bench``,
the benchmarks once) run most valuable first, each a subprocess with its own log and cap,
within ``--budget`` seconds (a step that no longer fits is skipped and says so; one past
its cap gets a Ctrl-C and 20 s to write what it has, then it is killed with its children).
After each, ``summary.md``: device, driver, CUDA, PyTorch, host CPU, every lever's verdict
and speedup, TFLOP/s against the device's dense peak, the tests' failures, the FP8
headroom, the train step and the overhead. ``--steps`` and ``--skip`` choose steps,
``--preset`` a lent machine's first or second call, and ``--export`` leaves at most eight
files, after each step too (the summary, the key JSON files and one archive of
everything). Without a GPU the same steps run on the CPU, small, and the check says no GPU
was found and exits 0 when they pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .machine import environment as _environment
from .machine import gpu_state
from .machine import install as _install
from .machine import installed as _installed
from .steps import (
    PRESETS,
    ROOT,
    STEP_NAMES,
    Step,
    plan,
    select,
    suite_files,
    suite_shards,
)

__all__ = ["PRESETS", "Step", "export", "main", "plan", "select", "suite_files", "suite_shards"]

# How long a step that ran past its cap gets, after a Ctrl-C, to write its results so far
INTERRUPT_GRACE_S = 20.0
# What --export copies beside the archive of everything (at most 8 files in all)
EXPORTED = (
    "summary.md",
    "steps.json",
    "environment.json",
    "bench.json",
    "verify.json",
    "fp8-headroom.json",
    "train-step.json",
)
ARCHIVE = "gpu-check.tar.gz"


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.update(extra)
    return env


def _answer_ctrl_c() -> None:
    # In the step's process, before it runs: Ctrl-C as by default, so that the step asked to
    # stop at its cap writes what it has. A check started in the background by a shell
    # without job control (a CI script's `cmd &`, a remote runner) ignores SIGINT, and its
    # children would inherit that and be killed at the end of the grace with nothing written.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process`` and every process it started (its own session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (OSError, AttributeError):  # gone already, or no process groups (not POSIX)
        process.kill()


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
        """Wait for the end; past the cap less a grace, Ctrl-C it (pytest, bench and the
        scripts then write what they have), then kill what is left of it."""
        grace = min(INTERRUPT_GRACE_S, self.cap / 4)
        left = self.cap - grace - (time.perf_counter() - self.started)
        record, expect = self.record, self.step.expect
        rc: int | None = None
        try:
            rc = self.process.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                record["rc_after_ctrl_c"] = self.process.wait(timeout=grace)
            _kill_group(self.process)  # what is left, its children too (xdist's workers)
            self.process.wait()
        self.log.close()
        record["seconds"] = round(time.perf_counter() - self.started, 1)
        record["rc"] = rc
        if rc is None:
            record["status"] = f"TIMED OUT after {self.cap:.0f} s"
        elif rc == expect:
            record["status"] = "passed" if rc == 0 else f"passed (exit {rc}, as expected)"
        else:
            record["status"] = f"FAILED (exit {rc}, expected {expect})"
        if self.step.gpu_state:
            record["gpu_state_after"] = gpu_state()
        return record

    def kill(self) -> None:
        """End it now (the check itself was interrupted)."""
        if self.process.poll() is None:
            _kill_group(self.process)
            self.process.wait()
        self.log.close()


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
    fh.write("$ " + shlex.join(command) + "\n\n")
    fh.flush()
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
        command,
        stdout=fh,
        stderr=subprocess.STDOUT,
        env=_env(step.env),
        cwd=ROOT,
        start_new_session=True,  # a group of its own: killed whole when past its cap
        preexec_fn=_answer_ctrl_c,
    )
    return _Launched(step, record, process, fh, cap, time.perf_counter())


def _run(step: Step, out: str, python: str, left: float) -> dict[str, Any]:
    """Run ``step`` to its end (or its cap); its record."""
    launched = _launch(step, out, python, left)
    return launched.finish() if isinstance(launched, _Launched) else launched


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check",
        description="Everything a GPU machine should prove, into one folder (docs/gpu_check.md).",
    )
    parser.add_argument("--out", required=True, help="the folder everything is written to")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds for all steps (530; a preset's own)"
    )
    parser.add_argument(
        "--steps",
        default=None,
        help="comma-separated steps to run (default: all): " + ", ".join(STEP_NAMES),
    )
    parser.add_argument("--skip", default="", help="comma-separated steps not to run")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a lent machine's call: 'first' runs every step but the untimed benchmarks "
        "within 400 s; 'second' the GPU tests and the steps --steps names, within 220 s",
    )
    parser.add_argument(
        "--bench-workloads", default=None, help="comma-separated workloads for the bench step"
    )
    parser.add_argument(
        "--bench-args", default="", help="more arguments for the bench step, e.g. '--passes 2'"
    )
    parser.add_argument(
        "--suite-workers",
        type=int,
        default=None,
        help="pytest-xdist processes for the suite (default: half the cores, at most 8; "
        "0: eight processes of a fixed share of the files each)",
    )
    parser.add_argument(
        "--suite-cap",
        type=float,
        default=None,
        help="seconds the suite may run (300; a preset's own: 230 first, 200 second)",
    )
    parser.add_argument(
        "--suite-tests",
        default=None,
        help="comma-separated test files or test ids for the suite step instead of every file "
        "(e.g. the first call's failures)",
    )
    parser.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="at the end, copy the summary, the key JSON files and one archive of "
        f"everything ({ARCHIVE}) into DIR: at most 8 files",
    )
    return parser


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [n.strip() for n in text.split(",") if n.strip()]


def _settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str] | None, float, float, list[str]]:
    """(the chosen steps, the budget, the suite's cap, the bench's extra arguments)."""
    if args.export is not None and os.path.abspath(args.export) == os.path.abspath(args.out):
        parser.error("--export must be another folder than --out (it gets at most 8 files)")
    chosen = _names(args.steps)
    budget, suite_cap = 530.0, 300.0
    if args.preset is not None:
        preset_steps, budget, suite_cap = PRESETS[args.preset]
        if args.preset == "first" and chosen is None:
            chosen = list(preset_steps)
        elif args.preset == "second":
            chosen = [*preset_steps, *(chosen or [])]
    if args.budget is not None:
        budget = args.budget
    if args.suite_cap is not None:
        if args.suite_cap <= 0:
            parser.error(f"--suite-cap {args.suite_cap:g}: expected a number of seconds above 0")
        suite_cap = args.suite_cap
    bench_args = shlex.split(args.bench_args)
    if args.bench_workloads:
        bench_args = ["--workload", args.bench_workloads, *bench_args]
    return chosen, budget, suite_cap, bench_args


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks end every step still running


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return 0 when every step that ran passed."""
    parser = _parser()
    args = parser.parse_args(argv)
    chosen, budget, suite_cap, bench_args = _settings(parser, args)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    import torch

    gpu = bool(torch.cuda.is_available())
    suite = {"suite_workers": args.suite_workers, "suite_cap_s": suite_cap,
             "suite_tests": _names(args.suite_tests) or ()}  # fmt: skip
    steps = plan(out, gpu, bench_args=bench_args, **suite)
    try:
        select(steps, chosen, _names(args.skip) or ())
    except ValueError as exc:
        parser.error(str(exc))
    found = f"GPU found: {torch.cuda.get_device_name(0)}" if gpu else (
        "no GPU found (torch.cuda.is_available() is False): running the CPU parts only"
    )  # fmt: skip
    print(f"speedflags gpu-check: {found}", flush=True)
    env = _environment(gpu)
    env["argv"] = list(sys.argv[1:] if argv is None else argv)
    python = sys.executable
    if not _installed(python):
        env["install"] = _install(python, out)
    with open(os.path.join(out, "environment.json"), "w", encoding="utf-8") as fh:
        json.dump(env, fh, indent=2, default=str)
    records: dict[str, dict[str, Any]] = {}

    def done(record: dict[str, Any]) -> None:
        records[record["name"]] = record
        print(f"  {record['name']}: {record['status']} ({record['seconds']:.0f} s)", flush=True)
        _write_steps(out, records)
        _publish(out, args.export)  # so far: a run cut short still leaves its results

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        _run_steps(steps, out, python, budget - (time.perf_counter() - started), records, done)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    records = {s.name: records[s.name] for s in steps}  # the plan's order in steps.json
    _write_steps(out, records)
    text = _publish(out, None)
    print(text)
    elapsed = time.perf_counter() - started
    failed = [n for n, r in records.items() if r["status"].startswith(("FAILED", "TIMED OUT"))]
    verdict = f"failed: {', '.join(failed)}" if failed else "every step that ran passed"
    where = "" if gpu else " (no GPU found: CPU parts only)"
    print(f"speedflags gpu-check: {verdict}{where}; {elapsed:.0f} s; everything is in {out}")
    if args.export is not None:
        copied = export(out, args.export)
        print(f"speedflags gpu-check: exported {', '.join(copied)} to {args.export}")
    return 1 if failed else 0


def _run_steps(
    steps: list[Step],
    out: str,
    python: str,
    budget: float,
    records: dict[str, dict[str, Any]],
    done: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``steps`` in order within ``budget`` seconds, those ``alongside`` beside the
    next until a ``quiet`` one; whatever way this ends, no step is left running."""
    started = time.perf_counter()
    running: list[_Launched] = []  # started and not finished, the alongside ones first
    try:
        for step in steps:
            if step.quiet:
                while running:
                    done(running.pop(0).finish())
            launched = _launch(step, out, python, budget - (time.perf_counter() - started))
            if not isinstance(launched, _Launched):
                done(launched)
            elif step.alongside:
                records[step.name] = {"name": step.name, "status": "running"}
                running.append(launched)
            else:
                running.append(launched)
                record = launched.finish()
                running.remove(launched)
                done(record)
        while running:
            done(running.pop(0).finish())
    finally:
        for launched in running:  # the check was interrupted: leave nothing running
            launched.kill()


def _publish(out: str, target: str | None) -> str:
    """Write ``summary.md`` from what the steps wrote so far, and export it all to
    ``target`` when given; the summary."""
    from .summary import render

    text = render(out)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    if target is not None:
        export(out, target)
    return text


def _write_steps(out: str, records: dict[str, dict[str, Any]]) -> None:
    with open(os.path.join(out, "steps.json"), "w", encoding="utf-8") as fh:
        json.dump({"steps": list(records.values())}, fh, indent=2)


def export(out: str, target: str) -> list[str]:
    """Copy into ``target`` the summary and the key JSON files of the ``out`` folder, with
    one archive of all of it (``gpu-check.tar.gz``): at most 8 files, none in a subfolder.

    Returns:
        The names written, the archive first.

    Example:
        >>> import json, os, tarfile, tempfile
        >>> from tools.gpu_check.check import export
        >>> out, target = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> for name in ("summary.md", "bench.log", "suite.xml"):
        ...     _ = open(os.path.join(out, name), "w").write("x")
        >>> export(out, target)
        ['gpu-check.tar.gz', 'summary.md']
        >>> sorted(tarfile.open(os.path.join(target, "gpu-check.tar.gz")).getnames())
        ['gpu-check/bench.log', 'gpu-check/suite.xml', 'gpu-check/summary.md']
    """
    os.makedirs(target, exist_ok=True)
    archive = os.path.join(target, ARCHIVE)
    with tarfile.open(archive, "w:gz") as tar:
        for name in sorted(os.listdir(out)):
            path = os.path.join(out, name)
            if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(archive):
                tar.add(path, arcname=f"gpu-check/{name}")
    written = [ARCHIVE]
    for name in EXPORTED:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(target, name))
            written.append(name)
    return written


if __name__ == "__main__":
    sys.exit(main())
