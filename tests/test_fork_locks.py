"""A fork never leaves a forked child waiting for a lock: every lock speedflags takes is
free in the child, whoever held it in the parent at the fork.

``os.fork()`` copies only the forking thread; a lock another thread held at that moment
would stay held in the child for ever. The hang is reproduced here deterministically: the
other thread is made to hold the lock (an event says when), and the main thread forks then;
nothing races. Each child has an alarm as a safety net, so that a regression fails instead
of hanging the suite; no test passes by waiting.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import autocast_enabled

import speedflags
from speedflags import _locks
from speedflags._hardware import cpu as hardware_cpu

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

PACKAGE = Path(speedflags.__file__).resolve().parent
# what makes a lock, a condition or anything built on one, outside speedflags._locks
LOCK_MAKERS = {
    ("threading", name)
    for name in ("Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore", "Event", "Barrier")
} | {("_thread", "allocate_lock"), ("_thread", "RLock"), ("_thread", "LockType")}
ALARM_S = 60  # a child that hangs is killed by this alarm: the test fails, it does not hang


def _in_child(check: Callable[[], int]) -> int:
    """Fork; the child runs ``check`` (its return value is the exit status) and never
    returns into pytest. The parent waits for the child's end and returns its status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:
        code = 99
        try:
            signal.alarm(ALARM_S)
            code = check()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)  # -SIGALRM: it hung
    return os.WEXITSTATUS(status)


@contextmanager
def held_in_a_thread(locks: list[Any]) -> Iterator[None]:
    """Another thread holds ``locks`` for the duration (entered once it holds them all)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        holding.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()

    thread = threading.Thread(target=hold, name="holds the locks")
    thread.start()
    try:
        assert holding.wait(ALARM_S), "the thread never took the locks"
        yield
    finally:
        release.set()
        thread.join()


def _package_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages([str(PACKAGE)], "speedflags.")
        if not info.name.startswith("speedflags.integrations.")  # optional libraries
    ]


def _module_locks() -> dict[str, Any]:
    """Every lock a speedflags module holds at module level (and each model lever class's),
    by where it is."""
    kinds = (type(threading.Lock()), type(threading.RLock()))
    found: dict[str, Any] = {}
    for name in _package_modules():
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if isinstance(value, kinds):
                found[f"{name}.{attribute}"] = value
            elif isinstance(value, type) and isinstance(vars(value).get("_lock"), kinds):
                found[f"{name}.{attribute}._lock"] = vars(value)["_lock"]
    return found


# --- the rule ------------------------------------------------------------------------------


def test_no_lock_is_made_outside_the_fork_safe_maker() -> None:
    # Failed before: fifteen locks were threading.Lock() or RLock() of their own, and a
    # child forked while another thread held one of them waited for it for ever.
    made: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "_locks":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name):
                if (call.value.id, call.attr) in LOCK_MAKERS:
                    made.append(f"{where}: {call.value.id}.{call.attr}()")
            elif isinstance(node, ast.ImportFrom) and node.module in ("threading", "_thread"):
                names = [a.name for a in node.names if (node.module, a.name) in LOCK_MAKERS]
                made.extend(f"{where}: from {node.module} import {n}" for n in names)
    assert not made, "make locks with speedflags._locks.new_lock():\n" + "\n".join(made)


def test_every_lock_the_package_holds_was_made_fork_safe() -> None:
    found = _module_locks()
    # the hardware cache's, the registry's, the warnings', the model levers' at least
    assert {"speedflags._hardware.cpu._lock", "speedflags.levers.registry._lock"} <= set(found)
    assert "speedflags._warn._lock" in found
    assert any(key.endswith("ParamDtypeLever._lock") for key in found), sorted(found)
    made = list(_locks._MADE)
    assert [where for where, lock in found.items() if not any(lock is m for m in made)] == []


# --- in a child ----------------------------------------------------------------------------


def test_a_child_finds_every_lock_another_thread_held_at_the_fork_free() -> None:
    # The ledger's own lock is held across the fork by the forking thread, which waits for
    # it (speedflags._ledger.threads): a thread holding it at the fork would hold up the
    # fork, not the child. Every other lock is held by another thread at the fork.
    ledger_lock = speedflags.ledger().lock
    locks = [lock for lock in _module_locks().values() if lock is not ledger_lock]
    mine = _locks.new_lock()  # one more, made now: the locks made later count too
    locks.append(mine)

    def check() -> int:
        still_held = 0
        for lock in locks:
            if lock.acquire(blocking=False):
                lock.release()
            else:
                still_held += 1
        return still_held

    with held_in_a_thread(locks):
        status = _in_child(check)
    assert status == 0, f"{status} of {len(locks)} locks still held in the child"


def test_a_lock_the_forking_thread_holds_stays_its_own_in_the_child() -> None:
    lock = _locks.new_lock()

    def check() -> int:
        # held by this thread (it forked inside the block): reentrant, and released once
        if not lock._is_owned():  # type: ignore[attr-defined]
            return 1
        lock.release()
        return 0 if lock.acquire(blocking=False) else 2

    with lock:
        status = _in_child(check)
    assert status == 0, status


@pytest.mark.usefixtures("cpu_with_bf16")
def test_a_fork_while_another_thread_probes_on_its_first_block_gives_a_usable_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Failed before (the child hung on the CPU-capability cache's lock, which the parent's
    # thread held, probing, at the fork): a thread enters its first fast_math block, which
    # tries this CPU's bf16 kernels once per process, while the main thread forks, as a
    # DataLoader's workers or a fork-method multiprocessing pool do. The probe is the real
    # one; it is only made to wait, in the parent's thread, until the child is done, so that
    # the fork lands inside it every time. The CPU is faked to have bf16 instructions, so
    # that the probe runs on every CPU (without them there is nothing to try).
    parent = os.getpid()
    probing, release = threading.Event(), threading.Event()
    real = hardware_cpu.try_cpu_kernels

    def probe_held_open(dtype: torch.dtype) -> Any:
        if os.getpid() == parent:
            probing.set()
            release.wait()
        return real(dtype)

    monkeypatch.setattr(hardware_cpu, "try_cpu_kernels", probe_held_open)
    monkeypatch.delitem(hardware_cpu._cache, torch.bfloat16, raising=False)  # first asked now
    speedflags._hardware._clear_cache()
    spec = speedflags.fast_math(amp="bf16", device="cpu", label="first block, in a thread")

    def first_block() -> None:
        with spec:
            pass

    def check() -> int:
        with speedflags.fast_math(amp="bf16", device="cpu", label="the child's first block"):
            return 0 if autocast_enabled("cpu") else 3

    thread = threading.Thread(target=first_block, name="first block")
    thread.start()
    try:
        assert probing.wait(ALARM_S), "the first block never probed the CPU"
        assert hardware_cpu._lock.acquire(blocking=False) is False  # held by the thread
        status = _in_child(check)
    finally:
        release.set()
        thread.join()
    assert status == 0, "the child hung (killed by its alarm)" if status < 0 else status
