"""The leak report's pytest side: findings gathered from test reports, printed as a terminal
summary section and written as ``--speedflags-report`` JSON, merged across pytest-xdist workers.

How findings reach the process that prints them: the test's protocol (where the flags are
compared) sets ``report.speedflags_leak`` (:data:`ATTRIBUTE`) on one of the test's reports,
and :class:`LeakReport` picks it up in ``pytest_runtest_logreport``. Without xdist that is the
same process; under xdist pytest serialises every attribute of a report (its whole
``__dict__``: the way ``wasxfail`` travels too) and the controller's report carries it again.
Chosen over ``workeroutput``/``pytest_testnodedown`` because each finding arrives with its
test's outcome: a worker that crashes or is killed later loses nothing already reported, and
nothing depends on a worker's session ending cleanly. Chosen over ``user_properties`` because
those also land in JUnit XML files as properties.

The summary is written with the terminal reporter itself (``write_sep``/``write_line``), so no
warnings setting hides it (``--disable-pytest-warnings``, ``-p no:warnings``, ``-W ignore``,
``-q``); only the absence of a terminal (``-p no:terminal``) does.

Example (what the plugin does at configure time)::

    path = check_report_path("leaks.json", config.invocation_params.dir)  # or UsageError
    config.pluginmanager.register(LeakReport("warn", path), "speedflags-leak-report")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from .findings import Finding, document, summary

__all__ = ["ATTRIBUTE", "OPTION", "TORCH_ATTRIBUTE", "LeakReport", "check_report_path"]

ATTRIBUTE = "speedflags_leak"
# settings PyTorch changed by itself during a test: information, never a leak
TORCH_ATTRIBUTE = "speedflags_torch_writes"
OPTION = "--speedflags-report"


def check_report_path(value: str, base: Path) -> Path:
    """The report file's path (relative to ``base``), or a usage error naming the option.

    Checked at pytest's start, so an unwritable path fails before any test runs rather than
    after the whole suite.

    >>> check_report_path("leaks.json", Path("/tmp"))
    PosixPath('/tmp/leaks.json')
    >>> try:
    ...     check_report_path("/nonexistent-dir/leaks.json", Path("/tmp"))
    ... except pytest.UsageError as exc:
    ...     print(exc)
    --speedflags-report=/nonexistent-dir/leaks.json: the directory /nonexistent-dir does not exist
    """
    if not value.strip():
        raise pytest.UsageError(f"{OPTION}: expected a file name, e.g. {OPTION}=leaks.json")
    path = base / Path(value).expanduser()
    problem = ""
    if path.is_dir():
        problem = f"{path} is a directory; give a file name, e.g. {path / 'leaks.json'}"
    elif not path.parent.is_dir():
        problem = f"the directory {path.parent} does not exist"
    elif not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = f"{path} is not writable"
    if problem:
        raise pytest.UsageError(f"{OPTION}={value}: {problem}")
    return path


class LeakReport:
    """Gathers the findings of a session (every worker's, under xdist); prints and writes them.

    Registered in the process that prints the terminal summary (never in an xdist worker):
    ``mode`` is the ``--speedflags-leaks`` value, ``path`` the JSON file or None.
    """

    def __init__(self, mode: str, path: Path | None) -> None:
        self.mode = mode
        self.path = path
        self.findings: list[Finding] = []
        self.failed: set[str] = set()  # the tests (node ids) with a failed report
        self.by_torch: list[str] = []  # each once
        self.problem = ""  # why the file could not be written, once tried

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        found = getattr(report, ATTRIBUTE, None)  # on one report of a leaking test only
        if found is not None:
            self.findings.append(found)
        for note in getattr(report, TORCH_ATTRIBUTE, None) or ():
            if note not in self.by_torch:
                self.by_torch.append(note)

    # Every report is in by now: xdist's run loop ends once the last one has arrived. The
    # terminal reporter prints its summary after this (its own sessionfinish wraps this one).
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.path is None:
            return
        text = json.dumps(document(self.findings, self.mode), indent=2) + "\n"
        try:
            self.path.write_text(text, encoding="utf-8")
        except OSError as exc:  # checked at the start; the directory may have gone since
            self.problem = f"speedflags: could not write {OPTION}={self.path}: {exc}"

    def outcome(self) -> str:
        """What became of the leaking tests, as the summary's last line says it: in ``warn``
        mode a leak alone fails no test, but a warnings filter turning ``FlagLeakWarning``
        into an error (``-W error``) does, and a test may fail for reasons of its own."""
        if self.mode == "fail":
            return "these tests failed"
        ids = list(dict.fromkeys(found["nodeid"] for found in self.findings))
        failed = [nodeid for nodeid in ids if nodeid in self.failed]
        if not failed:
            return "they passed"
        why = "FlagLeakWarning is an error here (-W error), or a failure of their own"
        if len(failed) == len(ids):
            return f"they failed ({why})"
        return f"{len(failed)} of them failed ({why}): {', '.join(failed)}; the others passed"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.mode != "off":  # with only a report file asked for, the file says "off"
            title, lines = summary(self.findings, self.mode)
            colour = "green" if not lines else "red" if self.mode == "fail" else "yellow"
            terminalreporter.write_sep("=", title, **{colour: True})
            for line in lines:
                terminalreporter.write_line(line)
            if lines:
                terminalreporter.write_line(
                    f"(--speedflags-leaks={self.mode}: {self.outcome()}; speedflags put every "
                    "setting back after its test)"
                )
        if self.by_torch and self.mode != "off":
            terminalreporter.write_line(
                "speedflags: PyTorch changed these settings by itself (not a leak; left as "
                "PyTorch set them):"
            )
            for note in self.by_torch:
                terminalreporter.write_line(f"  {note}")
        if self.path is not None:
            done = f"speedflags: report written to {self.path}"
            terminalreporter.write_line(self.problem or done, red=bool(self.problem))
