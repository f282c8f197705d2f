"""``speedflags.watch()``: who changed my flags?

While watching, every write to a lever's torch state made through Python, by any code and
in any thread, is recorded in :func:`speedflags.ledger`'s history as a ``FlagRecord`` with
``action == "external"``: ``lever`` (``tf32``, ``matmul_precision``, ``cudnn_benchmark``,
``sdpa``, ``deterministic``, ``reduced_precision_reduction``, ``amp``: the lever's name,
as in ``fast_math`` and speedflags' own records), ``before`` and ``after``,
``thread``, ``label`` (the writer's function name), ``where`` (``"file:line"`` of the first
frame outside torch, speedflags, ``contextlib`` and ``functools``: for
``with torch.backends.cudnn.flags(...)``, the ``with`` line) and ``reason`` (the write in
words, with who and where). Only writes that change the state are recorded, and
speedflags' own writes are not external.

Every Python path is covered: the legacy ``allow_tf32`` of cuBLAS and cuDNN,
``fp32_precision`` at every level, ``torch.set_float32_matmul_precision``,
``cudnn.benchmark``, ``cudnn.flags()``/``set_flags``, the SDPA ``enable_*_sdp`` functions
and ``sdpa_kernel``, the autocast setters and ``torch.autocast``: they all end in a few
``torch._C`` functions, which are wrapped while watching (:mod:`speedflags._watch.setters`).
A change made around Python (C++) is found at the next ledger boundary and recorded as made
by unknown code between two named points. Errors and reports then name the last writer:
``MixedTF32APIError``, ``DriftWarning``, ``tf32_status().last_written_by`` and
``speedflags report``.

Cost: nothing after ``stop()`` (every original is put back). While watching, a watched
write reads its state before and after, and a ledger frame reads every lever's state twice
(``benchmarks/test_watch_overhead.py``). Code compiled by ``torch.compile`` while watching
may graph-break where it writes these flags.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._ledger.history import FlagRecord
from .._ledger.ledger import ledger
from .setters import writer_frame
from .watcher import _watcher

__all__ = ["ENV", "Watch", "start_from_env", "watch"]

ENV = "SPEEDFLAGS_WATCH"
F = TypeVar("F", bound=Callable[..., Any])


class Watch:
    """Records who writes the levers' torch state; a context manager, or ``start``/``stop``.

    Returned by :func:`speedflags.watch`. Like ``unittest.mock.patch``: ``with watch():``,
    ``w = watch(); w.start(); ...; w.stop()``, or ``@watch()`` on a function. Watches may
    nest and overlap; the wrappers are installed while at least one is started and removed,
    originals put back exactly, when the last one stops. ``stop()`` on a watch that is not
    started does nothing.

    Scope: process (every thread's writes). Restores: nothing (it only records).

    Attributes:
        active: whether this watch is started.
        records: the ``"external"`` records made while this watch was started (from the
            ledger's history, which keeps the most recent 4096 records).
    """

    def __init__(self) -> None:
        self.active = False
        self._since: float | None = None
        self._until: float | None = None

    def start(self) -> Watch:
        """Start watching (see the class); returns the watch."""
        if self.active:
            raise RuntimeError("this speedflags.watch() is already started")
        caller = writer_frame()
        where = (caller.f_code.co_filename, caller.f_lineno) if caller is not None else None
        self._since, self._until = time.time(), None
        _watcher().start(where)
        self.active = True
        return self

    def stop(self) -> None:
        """Stop watching; the wrappers go when the last started watch stops."""
        if not self.active:
            return
        self.active = False
        self._until = time.time()
        _watcher().stop()

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __call__(self, func: F) -> F:
        """As a decorator (like ``mock.patch``): each call of ``func`` runs under its own watch."""

        @functools.wraps(func)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with Watch():
                return func(*args, **kwargs)

        return watched  # type: ignore[return-value]

    @property
    def records(self) -> tuple[FlagRecord, ...]:
        if self._since is None:
            return ()
        since, until = self._since, self._until
        return tuple(
            r
            for r in ledger().history
            if r.action == "external" and r.time >= since and (until is None or r.time <= until)
        )

    def __repr__(self) -> str:
        return f"<speedflags.watch() {'started' if self.active else 'stopped'}>"


def watch() -> Watch:
    """Record every write to a lever's torch state, by any code, with its ``file:line``.

    While on, each change to TF32, the matmul precision, cuDNN benchmark, the SDPA backends
    or autocast made through Python (by your code, a library, torch itself) is appended to
    :func:`speedflags.ledger`'s history as a ``FlagRecord`` with ``action == "external"``,
    and errors and reports name the last writer. ``SPEEDFLAGS_WATCH=1`` starts one at import.

    Scope: process. Restores: nothing; it only records. Off, it costs nothing: ``stop()``
    removes every wrapper.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.watch() as w:
        ...     torch.backends.cudnn.benchmark = True
        ...     torch.backends.cudnn.benchmark = False
        >>> [(r.lever, r.before, r.after, r.label) for r in w.records]
        [('cudnn_benchmark', False, True, '<module>'), ('cudnn_benchmark', True, False, '<module>')]
        >>> w.records[0].reason
        'torch.backends.cudnn.benchmark set to True by <module> at <doctest ...>:2'
    """
    return Watch()


_FROM_ENV: Watch | None = None


def start_from_env() -> None:
    """Start a watch for the whole process when ``SPEEDFLAGS_WATCH`` is set (``1``, ``true``)."""
    global _FROM_ENV
    if _FROM_ENV is None and os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        _FROM_ENV = watch().start()
