"""What the leak check found in one test, as plain data: the shape of the JSON report.

A *finding* is a dict of JSON values only (str, int, bool, None, lists, dicts), so that it
travels unchanged inside a pytest report from an xdist worker to the controller and into the
``--speedflags-report`` file. The shape (``FORMAT`` names its version; fields are only ever
added)::

    {"nodeid": "tests/test_a.py::test_b[1]",
     "location": {"path": "tests/test_a.py", "line": 12},   # the test's ``def`` line (1-based)
     "worker": "gw0",                                       # the xdist worker, else null
     "settings": [                                          # one per changed setting
       {"lever": "cudnn_benchmark",                         # the lever(s), as in the text
        "name": "cudnn_benchmark",                          # the setting, as snapshot() keys it
        "before": "False", "after": "True",                 # Python reprs, as in the text
        "writer": {"file": "/abs/lib.py", "line": 4, "function": "configure",
                   "thread": "MainThread",
                   "text": "torch.backends.cudnn.benchmark set to True by configure at ..."},
        "writes": [...],            # every write seen during the test; ``writer`` is the last
        "put_back": true,           # false when restoring it raised (``problem`` says what)
        "problem": null}],
     "lines": ["  cudnn_benchmark: False -> True", "    write: ..."]}  # the text, as printed

``writer`` is null when no write through Python was seen (a C++ write, or a thread that had
not written before the watch started): the change was found, its author is unknown. A
change made by a speedflags block the test left open names that block instead (its
``function`` empty, its ``file``/``line`` where the block was entered).

Example:
    >>> write = write_info("torch.backends.cudnn.benchmark set to True by f at t.py:3",
    ...                    "f", ("t.py", 3), "MainThread")
    >>> item = finding("t.py::test_f", "t.py", 2, [setting(
    ...     "cudnn_benchmark", "cudnn_benchmark", "False", "True", [write])],
    ...     ["  cudnn_benchmark: False -> True"])
    >>> item["settings"][0]["writer"]["line"], item["location"]
    (3, {'path': 't.py', 'line': 2})
    >>> print("\\n".join(summary([item], "warn")[1]))
    t.py::test_f  (t.py:2)
      cudnn_benchmark: False -> True
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FORMAT", "def_location", "document", "finding", "setting", "summary", "write_info"]

FORMAT = "speedflags-leaks/1"
Finding = dict[str, Any]


def write_info(
    text: str, function: str, where: tuple[str, int] | None, thread: str
) -> dict[str, Any]:
    """One write, as JSON: ``file``/``line`` are null for a change found around Python.

    >>> write_info("x set to 1", "", None, "MainThread")["file"] is None
    True
    """
    file, line = where if where else (None, None)
    return {"file": file, "line": line, "function": function, "thread": thread, "text": text}


def setting(
    lever: str,
    name: str,
    before: str,
    after: str,
    writes: Sequence[dict[str, Any]],
    problem: str = "",
) -> dict[str, Any]:
    """One changed setting; ``writes`` in the order they were made (``writer`` is the last).

    >>> setting("sdpa", "sdpa.math", "True", "False", [])["writer"] is None
    True
    """
    return {
        "lever": lever,
        "name": name,
        "before": before,
        "after": after,
        "writer": writes[-1] if writes else None,
        "writes": list(writes),
        "put_back": not problem,
        "problem": problem or None,
    }


def finding(
    nodeid: str,
    path: str,
    line: int,
    settings: list[dict[str, Any]],
    lines: list[str],
    worker: str | None = None,
) -> Finding:
    """One test's leaks: its id, where its ``def`` is, the settings and the text lines.

    >>> finding("t.py::test_f", "t.py", 2, [], [], worker="gw1")["worker"]
    'gw1'
    """
    return {
        "nodeid": nodeid,
        "location": {"path": path, "line": line},
        "worker": worker,
        "settings": settings,
        "lines": lines,
    }


def document(findings: Sequence[Finding], mode: str) -> dict[str, Any]:
    """The ``--speedflags-report`` file: the format, the mode and every finding, in order.

    >>> document([], "fail")
    {'format': 'speedflags-leaks/1', 'mode': 'fail', 'tests': []}
    """
    return {"format": FORMAT, "mode": mode, "tests": list(findings)}


def summary(findings: Sequence[Finding], mode: str) -> tuple[str, list[str]]:
    """The terminal summary section: its title and its lines (each test named once).

    >>> summary([], "fail")
    ('speedflags: no test left torch settings changed', [])
    """
    if not findings:
        return "speedflags: no test left torch settings changed", []
    count = len(findings)
    title = f"speedflags: {count} test{'s' if count != 1 else ''} left torch settings changed"
    lines: list[str] = []
    for item in findings:
        where = f"{item['location']['path']}:{item['location']['line']}"
        worker = f", worker {item['worker']}" if item.get("worker") else ""
        lines.append(f"{item['nodeid']}  ({where}{worker})")
        lines += item["lines"]
    return title, lines


_DEF = re.compile(r"\s*(async\s+)?def\s")


def def_location(function: Callable[..., Any]) -> tuple[str, int] | None:
    """The source file of ``function`` and the 1-based line of its ``def``, below its
    decorators; None without source.

    A code object's first line is its first decorator's (``@pytest.mark.parametrize`` and
    the like), and pytest reports that line as the test's location; and a test imported into
    the module that collects it is defined in another file.

    >>> import json
    >>> path, line = def_location(json.dumps)
    >>> path == inspect.getsourcefile(json)
    True
    >>> inspect.getsource(json).splitlines()[line - 1].startswith("def dumps(")
    True
    >>> def_location(len) is None
    True
    """
    function = inspect.unwrap(getattr(function, "__func__", function))
    try:
        path = inspect.getsourcefile(function)
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    if path is None:
        return None
    try:
        node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    except (SyntaxError, IndexError):  # a source dedent cannot parse: the first def line
        found = next((first + n for n, text in enumerate(lines) if _DEF.match(text)), None)
        return None if found is None else (path, found)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return path, first + node.lineno - 1
    return None
