"""The ledger's hot path is written once, or checked here against the one source its copies
follow.

Enter and exit run on every block (``@speedup`` every training step), so a few of their
steps are written inline where a call would cost (``docs/architecture.md``, "The hot
path"): the scope's enter opens its frame as ``open_frame`` does, its exit closes the
innermost frame as ``close_innermost`` does, ``FlagLedger.close`` appends its restore entry as
``Ring.closed`` does, and ``FlagLedger.open`` makes the :class:`~speedflags.Frame` (which has
no ``__init__``). Each copy is read from the source and compared with what it copies; the
drain of held-back signal handlers, written out in every critical function, is checked to be
the one documented loop (``speedflags/_ledger/interrupts.py``).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import speedflags
from speedflags._ledger import entering, interrupts, ring, scope
from speedflags._ledger.frame import Frame
from speedflags._ledger.ledger import FlagLedger

LEDGER_PACKAGE = Path(speedflags.__file__).resolve().parent / "_ledger"


def tree_of(func: Callable[..., Any]) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    return node  # type: ignore[return-value]


def calls_named(tree: ast.AST, name: str) -> list[ast.Call]:
    """The calls of ``name`` (a function or a method, by its last name) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called == name:
                found.append(node)
    return found


def arguments(call: ast.Call, renamed: dict[str, str] | None = None) -> str:
    text = ", ".join(ast.unparse(arg) for arg in call.args)
    for old, new in (renamed or {}).items():
        text = text.replace(old, new)
    return text


def test_the_scopes_enter_opens_its_frame_as_open_frame_does() -> None:
    (inline,) = calls_named(tree_of(scope.FrameScope.__enter__), "open")
    (source,) = calls_named(tree_of(scope.FrameScope.open_frame), "open")
    assert arguments(inline, {"self._label": "label"}) == arguments(source)


def test_the_scopes_exit_closes_the_innermost_frame_as_close_innermost_does() -> None:
    # the common case: this context's last frame, opened by this scope and not closed
    def first_statements(func: Callable[..., Any], count: int) -> list[str]:
        body = [n for n in tree_of(func).body if not isinstance(n, ast.Expr)]  # no docstring
        return [ast.unparse(n) for n in body[:count]]

    exit_tree = tree_of(scope.FrameScope.__exit__)
    (inner_try,) = [n for n in ast.walk(exit_tree) if isinstance(n, ast.Try)]
    (branch,) = [n for n in inner_try.body if isinstance(n, ast.If)]  # compiling, or not
    inline = branch.orelse[3:6]  # after the caller's line and the ledger
    renamed = [
        ast.unparse(n).replace("the_ledger", "ledger").replace("is self", "is owner")
        for n in inline
    ]
    source = first_statements(entering.close_innermost, 3)
    assert renamed[:2] == source[:2]
    # the test of the common case, and the close it makes
    assert renamed[2].split(":")[0] == source[2].split(":")[0]
    assert "ledger.close(frame, where)" in renamed[2] and "ledger.close(frame, where)" in source[2]


def test_the_hot_close_appends_the_entry_ring_closed_appends() -> None:
    (inline,) = calls_named(tree_of(FlagLedger.close), "entry")
    (source,) = calls_named(tree_of(ring.Ring.closed), "entry")
    assert arguments(inline, {"_ring.now()": "now()"}) == arguments(source)


def test_open_makes_the_frame_whole() -> None:
    # Frame has no __init__: FlagLedger.open sets every slot (but the one only a decorated
    # body's suspension sets), so that Frame's declaration and its making agree
    assigned = {
        target.attr
        for node in ast.walk(tree_of(FlagLedger.open))
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "frame"
    }
    assert assigned == set(Frame.__slots__) - {"suspending"}


# --- the drain -------------------------------------------------------------------------------

DRAIN = """\
while True:
    if not PENDING:
        break
    deliver_pending()"""


def functions_of(path: Path) -> Iterator[tuple[ast.FunctionDef, list[str]]]:
    """Every function of ``path`` and the names of its decorators."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [ast.unparse(d).split("(")[0] for d in node.decorator_list]
            yield node, names  # type: ignore[misc]


def test_every_drain_is_the_documented_loop_in_critical_code() -> None:
    documented = re.sub(r"  # .*", "", interrupts.__doc__ or "")
    assert textwrap.indent(DRAIN, "    ") in documented  # the documented loop, its comment aside
    drains = 0
    for path in sorted(LEDGER_PACKAGE.glob("*.py")):
        for function, decorators in functions_of(path):
            own = [
                n
                for n in ast.walk(function)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "deliver_pending"
            ]
            if not own or function.name == "deliver_pending":
                continue
            loops = [n for n in ast.walk(function) if isinstance(n, ast.While)]
            shaped = [n for n in loops if ast.unparse(n) == DRAIN]
            where = f"{path.name}:{function.name}"
            # every call of deliver_pending is one drain loop, and the function is critical
            assert len(shaped) == len(own), f"{where}: deliver_pending() outside the drain loop"
            assert "critical" in decorators, where
            drains += len(shaped)
    assert drains >= 10  # the check reads the package (ledger, scope, entering, ...)


def test_the_drain_check_finds_a_drain_written_another_way(tmp_path: Path) -> None:
    source = tmp_path / "other.py"
    source.write_text("def f():\n    while PENDING:\n        deliver_pending()\n")
    ((function, _),) = list(functions_of(source))
    loops = [n for n in ast.walk(function) if isinstance(n, ast.While)]
    assert [ast.unparse(n) == DRAIN for n in loops] == [False]
