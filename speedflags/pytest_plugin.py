"""pytest plugin: fail (or warn about) tests that leave torch flags changed, and run tests
under levers with ``@pytest.mark.speedflags(...)``.

Installed with speedflags as the ``pytest11`` entry point ``speedflags``, so pytest loads it
by itself; inert by default. Without installing (a source checkout): ``-p
speedflags.pytest_plugin``. Both may be given; it registers once.

``--speedflags-leaks=off|warn|fail`` (or the ini option ``speedflags_leaks``; default
``off``). In ``warn`` and ``fail`` every lever's state and every guarded setting's
(:mod:`speedflags.levers.guarded`: default dtype and device, grad mode, ...) is read before
each test (before its setup) and after it (after its teardown). On a difference the test
fails (``fail``) or gets a ``FlagLeakWarning`` (``warn``), naming the test, each setting
with before and after, and the code that wrote it (``file:line``: :func:`speedflags.watch`
is on in these modes); in both modes the state is put back (through ``restore()``, recorded
on the ledger), so the next test starts clean. A change PyTorch made by itself is no leak:
it is listed once, as information, and left as PyTorch set it. Reading costs about thirty
getter calls per test (``benchmarks/test_watch_overhead.py``); a state is described only
when it differs.

Whatever the warnings settings, pytest's terminal summary gets a section ("speedflags: N
tests left torch settings changed") naming each leaking test once, at its ``def`` line, with
every setting's before and after and its writer; ``--speedflags-report=FILE.json`` writes
the same as JSON (:mod:`speedflags.leak_report.findings` documents the shape). Under
pytest-xdist each worker checks its own tests (``fail`` fails them there) and the controller
prints one merged section and writes one file (:mod:`speedflags.leak_report.collect`).

``@pytest.mark.speedflags(**levers)`` runs the test function (not its fixtures) under
``speedflags.fast_math(**levers)``; a lever or value ``fast_math`` refuses makes the test an
error, with ``fast_math``'s message.

To fail the test itself (not add an error at teardown), ``warn``/``fail`` run each test's
protocol as pytest does but hold its reports until the flags are compared; a plugin that
also replaces the protocol (pytest-rerunfailures) does not combine with them.

Scope: the pytest session; leaks are looked for in the process-wide levers, in the
autocast state of the thread that runs the tests, and in the model levers: a model left
under ``param_dtype`` or ``memory_format`` (a block entered and never exited) is named by
its tag and put back. A setting changed by a speedflags block that the test left open is
attributed to that block, with the line that entered it (speedflags' own writes are no
writes a watch reports).

Example (a ``conftest.py``, or the command line ``--speedflags-leaks=fail``)::

    # pytest.ini:   [pytest]
    #               speedflags_leaks = fail

    import pytest

    @pytest.mark.speedflags(tf32=True, amp="bf16", device="cpu")
    def test_fast_forward():
        ...
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Hashable
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from ._fast_math import FastMath, fast_math
from ._ledger.ledger import ledger
from ._short_repr import short_repr
from ._tracing import Where
from ._watch.setters import Domain, Write, domains, flatten
from ._watch.watch import watch
from ._watch.watcher import _watcher
from .errors import SpeedflagsError, SpeedflagsWarning
from .leak_report import findings
from .leak_report.collect import (
    ATTRIBUTE,
    OPTION,
    TORCH_ATTRIBUTE,
    LeakReport,
    check_report_path,
)
from .levers import registry
from .levers._base import Unreadable
from .levers._model_lever import OPEN_MODEL_LEVERS
from .levers.culprits import made_by_torch

__all__ = ["CHOICES", "FlagLeakWarning"]

CHOICES = ("off", "warn", "fail")
ENTRY_POINT = "speedflags"
MARKER = (
    "speedflags(**levers): run the test function under speedflags.fast_math(**levers), "
    "e.g. @pytest.mark.speedflags(tf32=True, amp='bf16')"
)
_SPEC = pytest.StashKey[FastMath | None]()
_GUARD = "speedflags-leak-guard"
_REPORT = "speedflags-leak-report"


class FlagLeakWarning(SpeedflagsWarning):
    """With ``--speedflags-leaks=warn``: a test left a torch flag changed (it was put back)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("speedflags", "speedflags: torch flag leaks")
    group.addoption(
        "--speedflags-leaks",
        dest="speedflags_leaks",
        default=None,
        choices=CHOICES,
        help="fail or warn about tests that leave TF32, matmul precision, cuDNN benchmark, "
        "SDPA or autocast changed, naming the code that wrote them (default: the ini option "
        "speedflags_leaks, else off)",
    )
    group.addoption(
        OPTION,
        dest="speedflags_report",
        default=None,
        metavar="FILE.json",
        help="also write what --speedflags-leaks found as JSON, for CI (under pytest-xdist: "
        "one file, every worker's findings)",
    )
    parser.addini(
        "speedflags_leaks",
        "off, warn or fail: what to do about a test that leaves torch flags changed",
        default="off",
    )


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    # Installed, this module is the entry point "speedflags"; "-p speedflags.pytest_plugin"
    # (or pytest_plugins) registers it under its module name. Registering one module under
    # two names is an error in pluggy, so the first registration blocks the other name.
    if plugin is not sys.modules[__name__]:
        return
    name = manager.get_name(plugin)
    other = __name__ if name == ENTRY_POINT else ENTRY_POINT
    if manager.get_plugin(other) is None and not manager.is_blocked(other):
        manager.set_blocked(other)


def _mode(config: pytest.Config) -> str:
    option = config.getoption("speedflags_leaks")
    if option is not None:
        return str(option)
    value = str(config.getini("speedflags_leaks") or "off").strip()
    if value not in CHOICES:
        raise pytest.UsageError(
            f"ini option speedflags_leaks = {short_repr(value)}: expected one of "
            f"{', '.join(CHOICES)}"
        )
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    mode = _mode(config)
    # An xdist worker checks its tests and sends its findings inside their reports; the
    # controller (or a run without xdist) gathers, prints and writes them.
    worker = getattr(config, "workerinput", None)
    manager = config.pluginmanager
    if not manager.has_plugin(_REPORT) and worker is None:
        value = config.getoption("speedflags_report")
        path = None if value is None else check_report_path(value, config.invocation_params.dir)
        if mode != "off" or path is not None:
            manager.register(LeakReport(mode, path), _REPORT)
    if mode != "off" and not manager.has_plugin(_GUARD):
        shown = manager.has_plugin("warnings")
        manager.register(LeakGuard(mode, worker and worker.get("workerid"), shown), _GUARD)


def pytest_unconfigure(config: pytest.Config) -> None:
    guard = config.pluginmanager.get_plugin(_GUARD)
    if isinstance(guard, LeakGuard):
        guard.close()
        config.pluginmanager.unregister(guard)
    report = config.pluginmanager.get_plugin(_REPORT)
    if report is not None:
        config.pluginmanager.unregister(report)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marks = list(item.iter_markers("speedflags"))
    if not marks:
        return
    levers: dict[str, Any] = {}
    for mark in reversed(marks):  # the closest mark (the function's) wins
        if mark.args:
            raise TypeError(
                f"@pytest.mark.speedflags{short_repr(mark.args)}: takes lever keyword arguments "
                "only, as speedflags.fast_math does (e.g. tf32=True)"
            )
        levers.update(mark.kwargs)
    levers.setdefault("label", f"@pytest.mark.speedflags on {item.nodeid}")
    try:
        item.stash[_SPEC] = fast_math(**levers)
        return
    except SpeedflagsError as exc:  # a bad lever or value: the test errors, with the reason
        refused = f"@pytest.mark.speedflags: {type(exc).__name__}: {exc}"
    pytest.fail(refused, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    spec = item.stash.get(_SPEC, None)
    if spec is None:
        yield
        return
    with spec:
        yield


State = tuple[Hashable, ...]


class LeakGuard:
    """The ``warn``/``fail`` half of the plugin: one per pytest session, watching throughout."""

    def __init__(self, mode: str, worker: str | None = None, shown: bool = True) -> None:
        self.mode = mode
        self.worker = worker  # the xdist worker's id, named in its findings
        self.warnings_plugin = shown  # pytest's warnings plugin is on: it shows warnings
        self._bind()
        self.watch = watch().start()

    def _bind(self) -> None:
        # Read twice per test: bound once per registry version (a lever registered by a
        # conftest, a test module or a test is watched from the next test on). A guarded
        # setting's raw getter skips its own try (one try for all below); a getter that
        # raises falls back to the guarded reads.
        self.version = registry.version
        self.domains: tuple[Domain, ...] = (*domains(), _MODEL_LEVERS)
        self._reads = tuple(domain.lever.read for domain in self.domains)
        self._fast = tuple(getattr(d.lever, "fast_read", d.lever.read) for d in self.domains)

    def close(self) -> None:
        self.watch.stop()

    def read(self) -> State:
        try:
            return tuple([read() for read in self._fast])
        except Exception:
            return tuple([read() for read in self._reads])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        # pytest's own protocol, with the reports held back until the flags are compared
        # after teardown: a leak then fails the test itself rather than adding an error.
        seen = _watcher().seen
        frames = {frame.id for frame in ledger().open_frames()}
        if registry.version != self.version:  # compared within one test over one set
            self._bind()
        before = self.read()
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        after = self.read()
        if after != before:
            after = self.torchs_own(item, reports, before, after)
        if after != before:
            shown, path, line = _def_location(item)
            message, found = self.leaked(item, (shown, path, line), before, after, seen, frames)
            if reports:  # travels with the report, to the summary (across xdist too)
                setattr(_target(reports), ATTRIBUTE, found)
            # warn: at the test; a filter making it an error (-W error) fails the test, the
            # message once (failed outside the handler, not "during handling of" the warning)
            if self.mode == "fail" or not self.warned(message, path, line):
                _fail(item, reports, message)
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def warned(self, message: str, path: str, line: int) -> bool:
        """Warn; False if a filter made it an error. With -p no:warnings Python would print it
        raw, a second report beside the summary: recorded and dropped then."""
        try:
            with warnings.catch_warnings(record=not self.warnings_plugin):
                warnings.warn_explicit(message, FlagLeakWarning, path, line)
        except FlagLeakWarning:
            return False
        return True

    def torchs_own(
        self, item: pytest.Item, reports: list[Any], before: State, after: State
    ) -> State:
        """``after``, less the changes PyTorch made by itself (a lazy first-call write): no
        test's leak, so left as torch set them and reported as information."""
        kept = list(after)
        notes: list[str] = []
        for i, (domain, was, now) in enumerate(zip(self.domains, before, after, strict=True)):
            if was == now:
                continue
            why = made_by_torch(domain.lever, was, now)
            if why is not None:
                kept[i] = was  # compared as unchanged; the state stays as torch left it
                notes.append(f"{domain.name}: {why} (during {item.nodeid})")
        if notes and reports:
            setattr(_target(reports), TORCH_ATTRIBUTE, notes)
        return tuple(kept)

    def leaked(
        self,
        item: pytest.Item,
        at: tuple[str, str, int],
        before: State,
        after: State,
        seen: int,
        frames: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> tuple[str, findings.Finding]:
        """Put every changed state back; say what changed and who wrote it (text, finding).
        ``frames``: the ids of the ledger's frames open before the test."""
        lines: list[str] = []
        settings: list[dict[str, Any]] = []
        the_ledger = ledger()
        label = f"pytest --speedflags-leaks: put back after {item.nodeid}"
        shown, path, line = at
        where = (path, line)
        restored: list[tuple[Domain, Any, Any, Any, str]] = []
        with the_ledger.lock, the_ledger.section(label, where):
            for domain, was, now in zip(self.domains, before, after, strict=True):
                if was == now:
                    continue
                try:
                    restored.append((domain, was, now, domain.lever.restore(was, now), ""))
                except Exception as exc:  # the others are still put back
                    restored.append((domain, was, now, now, f"could not put it back: {exc!r}"))
        for domain, was, now, back, problem in restored:
            describe = domain.lever.describe
            names = ", ".join(dict.fromkeys(n for n, _, _ in domain.views))
            off = False if domain is _MODEL_LEVERS else None  # a model absent: no lever on it
            changes = _changes(domain.views[0][1], describe(was), describe(now), off)
            writes: list[Write | None] = [*_watcher().writes_since(seen, domain.key)]
            seen_writes = [findings.write_info(w.sentence(), w.function, w.where, w.thread)
                           for w in writes if w is not None]  # fmt: skip
            blocks = [] if writes else _left_open(domain, frames)
            seen_writes += [findings.write_info(text, "", where, thread)
                            for text, where, thread in blocks]  # fmt: skip
            if len(changes) == 1 and not changes[0][0]:
                lines.append(f"  {names}: {changes[0][2]} -> {changes[0][3]}")
            else:
                lines.append(f"  {names}:")
                lines += [f"    {key}: {old} -> {new}" for key, _, old, new in changes]
            for write in writes or ([] if blocks else [None]):
                lines.append(f"    write: {_writer(write)}")
            lines += [f"    write: {text}" for text, _, _ in blocks]
            if problem:
                lines.append(f"    {problem}")
            settings += [findings.setting(names, name, old, new, seen_writes, problem)
                         for _, name, old, new in changes]  # fmt: skip
            the_ledger.note(domain.name, "restore", problem or label,
                            before=describe(now), after=describe(back), label=label,
                            where=where)  # fmt: skip
        header = (
            f"{item.nodeid} left torch flags changed (--speedflags-leaks={self.mode}); "
            "speedflags put them back:"
        )
        found = findings.finding(item.nodeid, shown, line, settings, lines, self.worker)
        return "\n".join([header, *lines]), found


def _changes(
    prefix: str, was: Any, now: Any, absent: Any = None
) -> list[tuple[str, str, str, str]]:
    """(key as shown, name as snapshot() keys it, before, after) per changed setting;
    ``absent`` stands for a key one of the two states does not have."""
    old = flatten("", was, {})
    new = flatten("", now, {})
    if set(old) == {""}:
        return [("", prefix, _shown(was), _shown(now))]
    keys = [*new, *(key for key in old if key not in new)]
    return [
        (key.lstrip("."), _name(prefix, key), _shown(old.get(key, absent)),
         _shown(new.get(key, absent)))
        for key in keys
        if old.get(key, absent) != new.get(key, absent)
    ]  # fmt: skip


def _left_open(domain: Domain, before: set[int]) -> list[tuple[str, Where, str]]:
    """The speedflags blocks opened during the test and still open that set a lever of
    ``domain``: (what to say, where it was entered, its thread). A block left open changes
    its levers through speedflags itself, which no watch reports as a write."""
    names = {name for name, _, _ in domain.views}
    found = []
    for frame in ledger().open_frames():
        if frame.id in before or not names.intersection(frame.levers):
            continue
        if domain is _MODEL_LEVERS:
            models = {getattr(lever, "state", None) for lever in frame.program.levers}
            tags = sorted(state.tag for state in models if state is not None)
            on = f" on {', '.join(tags)}" if tags else ""
        else:
            on = ""
        text = (
            f"the speedflags block {frame.label}{on}, entered at {frame.where} and never "
            "exited (still open)"
        )
        found.append((text, frame._where, frame.thread))
    return found


# The model levers, as one piece of state over every model (no process-wide state of their
# own: domains() has no entry for them); its record name says which levers it covers.
_MODEL_LEVERS = Domain(
    OPEN_MODEL_LEVERS.domain,
    False,
    OPEN_MODEL_LEVERS,
    OPEN_MODEL_LEVERS.name,
    (
        ("param_dtype", "model_levers", OPEN_MODEL_LEVERS),
        ("memory_format", "model_levers", OPEN_MODEL_LEVERS),
    ),
)


def _name(prefix: str, key: str) -> str:
    # the fp32_precision domain's keys are torch's own names; the others are fields of a lever
    return key.lstrip(".") if key.startswith(".torch.") else prefix + key


def _def_location(item: pytest.Item) -> tuple[str, str, int]:
    """(the file as pytest shows it, the file, the line) of the test's ``def``. pytest's
    location is the right file (where the function is defined, which is not the collecting
    module for an imported test) but a decorated test's first decorator line."""
    shown, zero_based = item.location[0], item.location[1] or 0
    function = getattr(item, "obj", None)
    found = findings.def_location(function) if callable(function) else None
    if found is None:
        return shown, str(item.path), zero_based + 1
    return shown, found[0], found[1]


def _shown(value: Any) -> str:
    # a getter that raises: its type is enough here (tf32_status() has the whole message)
    return f"<raises {value.error}>" if isinstance(value, Unreadable) else repr(value)


def _writer(write: Write | None) -> str:
    if write is None:
        return (
            "unknown: no write through Python was seen (C++, or a thread that had not "
            "written before)"
        )
    thread = f" (thread {write.thread!r})" if write.thread != "MainThread" else ""
    return write.sentence() + thread


def _target(reports: list[Any]) -> Any:
    # the report that speaks for the test: its call, else the last (a setup that failed)
    return next((r for r in reports if r.when == "call"), reports[-1])


def _fail(item: pytest.Item, reports: list[Any], message: str) -> None:
    if not reports:  # pragma: no cover - pytest always reports at least the setup
        return
    target = _target(reports)
    if target.failed:
        target.sections.append(("speedflags: torch flags leaked", message))
        return
    try:
        pytest.fail(message, pytrace=False)
    except pytest.fail.Exception:
        excinfo = pytest.ExceptionInfo.from_current()
    try:
        target.longrepr = item.repr_failure(excinfo)
    except Exception:  # an item type with its own failure format
        target.longrepr = message
    target.outcome = "failed"
    if hasattr(target, "wasxfail"):
        del target.wasxfail
