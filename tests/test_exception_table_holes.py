"""No signal can skip the ledger's ``try`` or ``with``: a check of the bytecode itself.

CPython 3.12 and 3.13 leave some instructions of a loop out of the exception table of the
``try`` (or ``with``) around it: the back edge (``JUMP_BACKWARD``) of a loop whose body ends
in an ``if`` without ``else``, and of a ``while cond:`` loop (CPython issue gh-148278 is of
the same kind). Python runs signal handlers at back edges, so an exception a plain handler
raises there (Ctrl-C's ``KeyboardInterrupt``) leaves the function as if it had no ``try``:
no roll-back, and a ``with lock:`` never releases the lock, so every other thread hangs at
its next block. It happened in CI, on Python 3.13.0.

This test reads the bytecode the running interpreter compiled for the ledger and every
module it calls while holding its lock or restoring flags, and names each loop with such a
hole: write it so that its body ends in a plain statement (``if not cond: continue``, a
``while True:`` with a ``break``), or move it into a function of its own (a call is covered).
"""

from __future__ import annotations

import dis
import importlib
import pkgutil
import sys
import types
from collections.abc import Callable, Iterator

import pytest

import speedflags
import speedflags.levers

# What runs inside the ledger's enters and exits, under its lock, or restores flags.
CRITICAL_MODULES = [
    "speedflags._ledger.decorate",
    "speedflags._ledger.entering",
    "speedflags._ledger.frame",
    "speedflags._ledger.history",
    "speedflags._ledger.interrupts",
    "speedflags._ledger.ledger",
    "speedflags._ledger.notices",
    "speedflags._ledger.own_writes",
    "speedflags._ledger.program",
    "speedflags._ledger.ring",
    "speedflags._ledger.scope",
    "speedflags._ledger.stacks",
    "speedflags._ledger.suspend",
    "speedflags._ledger.threads",
    "speedflags._ledger.unwind",
    "speedflags._tracing",
    "speedflags._warn",
    "speedflags._watch.watcher",
    "speedflags._fast_math",
    "speedflags._fast_math.in_graph",
    "speedflags.pytest_plugin",
    "speedflags._schedule",
    "speedflags._speedup",
    "speedflags._status",
    *sorted(m.name for m in pkgutil.iter_modules(speedflags.levers.__path__, "speedflags.levers.")),
]

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="exception tables exist from Python 3.11"
)


def handler_of(code: types.CodeType) -> Callable[[int], int | None]:
    entries = dis._parse_exception_table(code)  # type: ignore[attr-defined]

    def handler(offset: int) -> int | None:
        for entry in entries:
            if entry.start <= offset < entry.end:
                return int(entry.target)
        return None

    return handler


def is_cleanup_only(
    code: types.CodeType,
    target: int,
    handler: Callable[[int], int | None],
    seen: set[int] | None = None,
) -> bool:
    """True if the handler at ``target`` only tidies up a comprehension or generator and
    re-raises to no handler of this function (a hole there skips nothing that matters)."""
    seen = seen if seen is not None else set()
    if target in seen:
        return True
    seen.add(target)
    block = [i for i in dis.get_instructions(code) if i.offset >= target][:8]
    names = [i.opname for i in block]
    generator_end = "CALL_INTRINSIC_1" in names and any("STOPITERATION" in i.argrepr for i in block)
    comprehension = "PUSH_EXC_INFO" not in names and names[:1] == ["SWAP"] and "RERAISE" in names
    if not (generator_end or comprehension):
        return False
    outer = handler(target)
    return outer is None or is_cleanup_only(code, outer, handler, seen)


def holes(code: types.CodeType) -> Iterator[str]:
    handler = handler_of(code)
    instructions = list(dis.get_instructions(code))
    for k, instruction in enumerate(instructions):
        if instruction.opname != "JUMP_BACKWARD" or handler(instruction.offset) is not None:
            continue
        j = k - 1  # the last covered instruction before it: the region the loop is in
        while j >= 0 and handler(instructions[j].offset) is None:
            j -= 1
        region = handler(instructions[j].offset) if j >= 0 else None
        target = handler(int(instruction.argval))
        if region is None or region != target or is_cleanup_only(code, region, handler):
            continue  # the whole loop is outside any try, or only a comprehension's tidying
        if k and instructions[k - 1].opname == "CLEANUP_THROW":
            # Python 3.12 only (3.11 and 3.13 keep it covered): an ``await``'s throw path,
            # back to its END_SEND, is laid out after the loop. It runs only when a
            # throw() into the awaited step ends it normally; no line of ours to rewrite.
            continue
        yield f"{code.co_name}, line {instruction.positions.lineno}"
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from holes(const)


def module_holes(name: str) -> list[str]:
    module = importlib.import_module(name)
    path = module.__file__
    assert path is not None
    with open(path, encoding="utf-8") as source:
        code = compile(source.read(), path, "exec")
    return [f"{name}: {hole}" for hole in holes(code)]


@pytest.mark.parametrize("name", CRITICAL_MODULES)
def test_no_loop_inside_a_try_or_with_can_skip_its_handler(name: str) -> None:
    assert module_holes(name) == []


def test_the_check_finds_the_hole_it_looks_for() -> None:
    # The shape that hung CI: a `while cond:` loop inside `with lock:`. On Pythons whose
    # compiler covers it, the check must say nothing; on those that do not, it must say so.
    source = (
        "def f(lock, frames):\n"
        "    with lock:\n"
        "        while frames and frames[-1]:\n"
        "            frames = frames[:-1]\n"
        "    return frames\n"
    )
    code = compile(source, "<shape>", "exec")
    function = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    handler = handler_of(function)
    back_edges = [i for i in dis.get_instructions(function) if i.opname == "JUMP_BACKWARD"]
    uncovered = [i for i in back_edges if handler(i.offset) is None]
    assert list(holes(code)) == (["f, line 3"] if uncovered else [])
    fixed = source.replace(
        "        while frames and frames[-1]:\n",
        "        while True:\n            if not (frames and frames[-1]):\n                break\n",
    )
    assert list(holes(compile(fixed, "<shape>", "exec"))) == []
