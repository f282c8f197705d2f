"""Everything outside the ledger's package goes through its public API.

The ledger's frame API (``open``/``Frame.close``, ``frame()``'s scopes, ``lock``,
``section``, ``note``) is what the rest of speedflags uses; its private names (the lock as
``_lock``, the frame counter ``_last_id``, the parts) are the package's own. A caller that
reaches past the API would also have to handle the interruptions the API handles once.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import speedflags
from speedflags import FlagLedger

PACKAGE = Path(speedflags.__file__).resolve().parent
LEDGER_PACKAGE = Path(sys.modules[FlagLedger.__module__].__file__ or "").resolve().parent
# The issue's own check: what grep must not find outside the ledger's package.
GREP = re.compile(r"ledger\._|_LEDGER\._|\._lock\b|\._last_id|\._one\(")


def outside_the_ledger() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if LEDGER_PACKAGE not in path.parents:
            yield path


def names_a_ledger(node: ast.expr) -> bool:
    """Whether ``node`` is, by its spelling, a ledger: ``ledger()``, ``the_ledger``,
    ``_LEDGER``, ``self.ledger``, ``scope.ledger``, ``frame.ledger``."""
    if isinstance(node, ast.Call):
        return names_a_ledger(node.func) or (
            isinstance(node.func, ast.Name) and node.func.id == "ledger"
        )
    if isinstance(node, ast.Name):
        return "ledger" in node.id.lower() and not node.id.startswith("_ledger_")
    if isinstance(node, ast.Attribute):
        return node.attr.lower().endswith("ledger")
    return False


def private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or not names_a_ledger(node.value):
            continue
        # `_ledger.ledger()` (a module alias) is the public function of that module
        if isinstance(node.value, ast.Name) and node.value.id == "_ledger":
            continue
        found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_outside_the_ledger_touches_a_private_name_of_a_ledger() -> None:
    found = [use for path in outside_the_ledger() for use in private_uses(path)]
    assert found == []


def test_the_issues_grep_finds_nothing_outside_the_ledger() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in outside_the_ledger()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if GREP.search(line)
    ]
    assert found == []


# The ledger's parts: public attributes of FlagLedger for the frame API of its own package
# (speedflags/_ledger/protocol.py names them), not for the rest of speedflags
PARTS = ("stacks", "ring", "threads")


def part_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [
        f"{path.name}:{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in PARTS
        and names_a_ledger(node.value)
        and not (isinstance(node.value, ast.Name) and node.value.id == "_ledger")
    ]


def test_no_module_outside_the_ledger_uses_its_parts() -> None:
    assert [use for path in outside_the_ledger() for use in part_uses(path)] == []


def test_inside_the_ledger_only_the_ledger_touches_its_private_names() -> None:
    # the frame API (scope, entering, decorate, suspend) and the parts go through the
    # parts' public methods and attributes
    found = [
        use
        for path in sorted(LEDGER_PACKAGE.glob("*.py"))
        if path.name != "ledger.py"
        for use in private_uses(path)
    ]
    assert found == []


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    # the check can fail: each spelling of a ledger reaching a private name is found
    source = tmp_path / "caller.py"
    source.write_text(
        "the_ledger._lock\nledger()._last_id\n_LEDGER._one(1)\nself.ledger._table\n"
        "the_ledger.lock\nframe.close()\n_ledger.ledger()\n"
    )
    found = private_uses(source)
    assert sorted(use.rsplit(": ", 1)[1] for use in found) == [
        "._last_id",
        "._lock",
        "._one",
        "._table",
    ]
    assert sum(bool(GREP.search(line)) for line in source.read_text().splitlines()) == 4
