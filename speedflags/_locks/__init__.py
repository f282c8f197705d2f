"""Every lock speedflags takes, made so that a forked child finds it free.

``os.fork()`` copies a process with only the thread that forked: a lock another thread
held at that moment (a thread probing the CPU's bf16 kernels on its first ``fast_math``
block while the main thread starts a DataLoader's workers) stays held in the child, by a
thread that does not exist there, and the child's first block waits for it for ever.

So speedflags makes its locks here and nowhere else. :func:`new_lock` keeps a weak reference
to each lock it makes, and in a forked child (``os.register_at_fork``) every one still alive
that another thread held is made free again (``_at_fork_reinit``, as CPython's own
``threading`` and ``logging`` do for their locks). One the forking thread holds itself stays
held: that thread goes on in the child and releases it as it would have. The locks are
reentrant (``RLock``), which is how the child tells the two apart. A lock here guards a
check-then-publish (a cache filled on first use, a registry replaced whole): a child that
finds one free does the unfinished work again itself. The ledger's lock is, besides, held
across the fork by the forking thread (:mod:`speedflags._ledger.threads`), so that no block
is half-way through entering or exiting when the process is copied.

``tests/test_fork_locks.py`` holds the rule: no ``threading.Lock()`` (nor ``RLock``,
``Condition``, ``Semaphore``) made anywhere else in the package.

What this subpackage may import: the standard library only.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = ["new_lock"]

# every lock made here and still referenced: made free again in a forked child
_MADE: weakref.WeakSet[Any] = weakref.WeakSet()


def new_lock() -> threading.RLock:
    """A reentrant lock (``threading.RLock``) that a forked child finds free, unless the
    forking thread itself held it.

    Example:
        >>> from speedflags._locks import new_lock
        >>> lock = new_lock()
        >>> with lock, lock:  # reentrant
        ...     pass
    """
    lock = threading.RLock()
    _MADE.add(lock)
    return lock


def _free_in_child() -> None:
    # In the child right after the fork, where only the forking thread is alive: a lock that
    # another thread held would never be released.
    for lock in list(_MADE):
        if not lock._is_owned():
            lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):  # POSIX; there is no fork elsewhere
    os.register_at_fork(after_in_child=_free_in_child)
