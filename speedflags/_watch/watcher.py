"""The machinery behind :func:`speedflags.watch`: wrappers, boundaries and the last writers.

One :class:`_Watcher` per process installs the wrappers (:mod:`speedflags._watch.setters`
lists what they wrap) when the first watch starts and puts every original back when the
last one stops. A wrapped setter reads the state it writes before and after the call; a
change is recorded in the ledger's history as ``"external"`` and remembered as that state's
last writer. Writes made while ``OWN_WRITES.depth`` is above zero are speedflags' own and
pass straight through.

At each ledger boundary (:func:`speedflags._ledger.own_writes.section`) the watcher
compares every state with what it expected: a difference was made around Python (C++, or
PyTorch by itself, which its lever may recognise) and is recorded. A lock held by sections
and around each watched write keeps another thread's write from being taken for speedflags'
own, or the reverse. The last-writer maps answer the hooks of
:mod:`speedflags.levers.culprits` (``DriftWarning``, ``MixedTF32APIError``),
:func:`tf32_writer` and :func:`speedflags._watch.writers.last_writers`, and only while a
watch is on and the state is still the one the writer left.

Scope: process; autocast states per thread.

Example:
    >>> import torch, speedflags
    >>> from speedflags._watch.writers import last_writers
    >>> with speedflags.watch():
    ...     torch.backends.cudnn.benchmark = True
    ...     print(last_writers()["cudnn_benchmark"])
    ...     torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.benchmark set to True by <module> at <doctest ...>:2
"""

from __future__ import annotations

import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch._C as torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C

from .. import _warn
from .._ledger import own_writes as _own_writes
from .._ledger.history import format_where
from .._ledger.ledger import ledger
from .._ledger.own_writes import OWN_WRITES
from .._locks import new_lock
from .._short_repr import short_repr
from .._tracing import Where
from ..errors import SpeedflagsWarning
from ..levers import _fp32_model as family
from ..levers import culprits, registry
from ..levers._base import Guard, Lever
from ..levers.culprits import NOT_WATCHING, known_torch_write
from ..levers.guarded import Setting
from ..levers.registry import lever_spec
from .setters import (
    SETTERS,
    Domain,
    Setter,
    Write,
    domains,
    flatten,
    torch_writer,
    writer_frame,
)

__all__ = ["tf32_writer"]

_UNKNOWN = "unknown code"
NOT_SEEN = (
    "speedflags.watch() saw no Python write that explains it: it was set before watching "
    "started, or around Python (C++)."
)


class _Watcher:
    """The process's one set of wrappers, installed while at least one watch is started."""

    def __init__(self) -> None:
        self._bind()
        self.family = lever_spec("tf32").lever().domain
        self.count = 0  # started watches
        self.ever = False
        self._start_lock = new_lock()
        # The ledger's own lock, held by its sections while speedflags writes, and here around
        # each watched write: so one is never mistaken for the other across threads. One
        # lock, taken only with `with`, so that no interruption can leave it held.
        self._ledger_lock = ledger().lock
        self._patches: list[tuple[Any, str, Any]] = []
        self._expected: dict[str, Hashable] = {}
        self._local = threading.local()
        self._boundary: tuple[str, Where] = ("", None)
        self.last: dict[tuple[str, int | None], Write] = {}
        self.mixed_by: Write | None = None
        self.by_getter: dict[tuple[str, int | None], tuple[Write, Any]] = {}
        self.seen = 0  # writes remembered so far
        self.recent: deque[tuple[int, str, Write]] = deque(maxlen=256)  # (number, domain, write)

    def _bind(self) -> None:
        # every boundary reads every domain: (key, read, domain), bound once per version of
        # the registry (a lever registered while watching is watched from its next boundary)
        self.version = registry.version
        self.domains = domains()
        self._process_reads = [(d.key, d.lever.read, d) for d in self.domains if not d.thread]
        self._thread_reads = [(d.key, d.lever.read, d) for d in self.domains if d.thread]
        # those a ledger frame writes: every domain a lever holds (a lever of one's own over
        # a guarded setting included), not the guarded settings alone
        self._process_levers = [
            r for r in self._process_reads if not isinstance(r[2].lever, Setting)
        ]
        self._thread_levers = [r for r in self._thread_reads if not isinstance(r[2].lever, Setting)]

    def _rebind(self) -> None:
        """The registry changed: read its domains again; a new one's state now is expected."""
        self._bind()
        for reads, expected in (
            (self._process_reads, self._expected),
            (self._thread_reads, self._thread_expected()),
        ):
            for key, read, _ in reads:
                if key not in expected:
                    expected[key] = read()

    # --- install and remove ----------------------------------------------------------------

    def start(self, where: Where) -> None:
        with self._start_lock:
            if self.count == 0:
                the_ledger = ledger()
                with the_ledger.lock:  # no ledger section is half-way through
                    self._install()
                    self._local = threading.local()
                    self._expected = self._read(thread=False)
                    self._local.expected = self._read(thread=True)
                    self._boundary = ("speedflags.watch() started", where)
                    # what happened while nothing watched is unknown: forget the writers
                    self.last.clear()
                    self.by_getter.clear()
                    self.mixed_by = None
                    _own_writes.WATCHER = self
                    culprits.set_source(self)
            self.count += 1
            self.ever = True

    def stop(self) -> None:
        with self._start_lock:
            if self.count == 0:
                return
            self.count -= 1
            if self.count == 0:
                with ledger().lock:
                    _own_writes.WATCHER = None
                    culprits.set_source(None)
                    for owner, attr, original in reversed(self._patches):
                        setattr(owner, attr, original)
                    self._patches.clear()

    def _install(self) -> None:
        wrappers: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, wrapper)
        for setter in SETTERS.values():
            owner = torch_C if setter.owner == "torch._C" else torch
            original = getattr(owner, setter.name, None)
            if original is None:
                continue
            wrapper = self._wrap(original, setter)
            wrappers[id(original)] = (original, wrapper)
            self._patch(owner, setter.name, wrapper)
            if owner is torch_C and getattr(torch, setter.name, None) is original:
                self._patch(torch, setter.name, wrapper)  # re-exported: torch.set_autocast_*
        # The torch.backends module classes' descriptors (ContextProp) that hold a setter
        # itself rather than looking it up when called (cudnn.benchmark, cudnn.allow_tf32).
        for name, module in list(sys.modules.items()):
            if not name.startswith("torch.backends") or type(module) is types.ModuleType:
                continue
            for descriptor in list(vars(type(module)).values()):
                held = getattr(descriptor, "setter", None)
                pair = wrappers.get(id(held))
                if pair is not None and pair[0] is held:
                    self._patch(descriptor, "setter", pair[1])

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        self._patches.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def _wrap(self, original: Callable[..., Any], setter: Setter) -> Callable[..., Any]:
        names = {view[0] for domain in self.domains for view in domain.views}
        if setter.lever not in names:  # pragma: no cover - a table/registry mismatch
            raise ValueError(f"watch: setter {setter.name} names no lever: {setter.lever!r}")
        domains = tuple(
            d for d in self.domains if any(name == setter.lever for name, _, _ in d.views)
        )
        write = self.write

        def watched(*args: Any, **kwargs: Any) -> Any:
            if OWN_WRITES.depth or _own_writes.WATCHER is None:
                return original(*args, **kwargs)
            return write(original, setter, domains, args, kwargs)

        watched.__name__ = getattr(original, "__name__", setter.name)
        watched.__qualname__ = watched.__name__
        watched.__doc__ = getattr(original, "__doc__", None)
        watched.__wrapped__ = original  # type: ignore[attr-defined]
        return watched

    # --- watched writes --------------------------------------------------------------------

    def write(
        self,
        original: Callable[..., Any],
        setter: Setter,
        domains: tuple[Domain, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        found: list[tuple[Write, Domain, Any, Any]] = []
        try:
            with self._ledger_lock:
                befores = [d.lever.read() for d in domains]
                try:
                    return original(*args, **kwargs)
                finally:
                    found = self._learn(setter, args, kwargs, domains, befores)
        finally:
            the_ledger = ledger()
            for item, domain, before, after in found:  # outside our lock: note() takes the ledger's
                describe = domain.describer(setter.lever)
                the_ledger.note(item.lever, "external", item.sentence(),
                                before=describe(before), after=describe(after),
                                label=item.function, where=item.where)  # fmt: skip

    def _learn(
        self,
        setter: Setter,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        domains: tuple[Domain, ...],
        befores: list[Any],
    ) -> list[tuple[Write, Domain, Any, Any]]:
        try:
            changed = _changed(domains, befores)
            if not changed:
                return []
            frame = writer_frame()
            function = frame.f_code.co_name if frame is not None else "<unknown>"
            where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None
            inside = torch_writer()
            by_torch = (
                None
                if inside is None
                else (inside.f_code.co_name, (inside.f_code.co_filename, inside.f_lineno))
            )
            text = setter.describe(args, kwargs)
            thread = threading.current_thread().name
            out = []
            for domain, before, after in changed:
                item = Write(setter.lever, text, function, where, thread, after, by_torch)
                self._remember(item, domain, before, after)
                out.append((item, domain, before, after))
            return out
        except Exception as exc:  # never let watching break the code it watches
            _warn.warn_once(("watch", type(exc)), f"speedflags.watch(): {exc!r}", SpeedflagsWarning)
            return []

    def _remember(self, item: Write, domain: Domain, before: Any, after: Any) -> None:
        tid = threading.get_ident() if domain.thread else None
        self._expected_for(domain)[domain.key] = after
        self.last[(domain.key, tid)] = item
        self.seen += 1
        self.recent.append((self.seen, domain.key, item))
        if domain.key == self.family:
            if family.is_consistent(after):
                self.mixed_by = None
            elif family.is_consistent(before) or self.mixed_by is None:
                self.mixed_by = item
        for _, prefix, lever in domain.views:
            old = flatten(prefix, lever.describe(before), {})
            new = flatten(prefix, lever.describe(after), {})
            for key in new.keys() | old.keys():
                if old.get(key) != new.get(key):
                    self.by_getter[(key, tid)] = (item, new.get(key))

    def _expected_for(self, domain: Domain) -> dict[str, Hashable]:
        return self._thread_expected() if domain.thread else self._expected

    def _thread_expected(self) -> dict[str, Hashable]:
        # the thread's own __dict__: a getattr that misses costs ~10x (an AttributeError)
        expected: dict[str, Hashable] | None = self._local.__dict__.get("expected")
        if expected is None:
            expected = self._local.expected = {}
        return expected

    def _read(self, thread: bool) -> dict[str, Hashable]:
        return {d.key: d.lever.read() for d in self.domains if d.thread == thread}

    # --- ledger boundaries (speedflags._ledger.own_writes.Watcher) ---------------------

    def boundary(self, the_ledger: Any, label: str, where: Where) -> None:
        """Changes since the last boundary that no watched write explains: recorded as unknown."""
        if registry.version != self.version:
            self._rebind()
        for reads, expected in (
            (self._process_reads, self._expected),
            (self._thread_reads, self._thread_expected()),
        ):
            for key, read, domain in reads:
                now = read()
                was = expected.get(key)
                if was is None or was == now:
                    expected[key] = now
                    continue
                self._unexplained(the_ledger, label, where, domain, was, now)

    def _unexplained(
        self, the_ledger: Any, label: str, where: Where, domain: Domain, was: Any, now: Any
    ) -> None:
        previous, previous_where = self._boundary
        thread = threading.current_thread().name
        between = (
            f"between {short_repr(previous)} at {format_where(previous_where) or '?'} and "
            f"{short_repr(label)} at {format_where(where) or '?'}"
        )
        by_torch = known_torch_write(domain.lever, was, now)
        if by_torch is not None:
            text = f"changed by PyTorch itself, around Python: {by_torch}, {between}"
        else:
            text = (
                f"changed by {_UNKNOWN} (around Python: C++, or a path speedflags does "
                f"not wrap) {between}"
            )
        torch_frame = None if by_torch is None else ("PyTorch", None)
        item = Write(domain.name, text, "", None, thread, now, torch_frame)
        self._remember(item, domain, was, now)
        describe = domain.lever.describe
        # the caller (the ledger's boundary) holds the ledger's lock: note() takes it again
        the_ledger.note(domain.name, "external", text, before=describe(was),
                        after=describe(now), label=_UNKNOWN)  # fmt: skip

    def settled(self, label: str, where: Where, levers_only: bool = False) -> None:
        """After speedflags' own writes: their result is the expected state from now on.
        ``levers_only`` (a ledger frame): the guarded settings read at the boundary stand."""
        process, thread = self._process_reads, self._thread_reads
        if levers_only:
            process, thread = self._process_levers, self._thread_levers
        self._expected.update({key: read() for key, read, _ in process})
        self._thread_expected().update({key: read() for key, read, _ in thread})
        self._boundary = (label, where)

    # --- who wrote it --------------------------------------------------------------------

    def writes_since(self, seen: int, domain: str) -> list[Write]:
        """The writes to ``domain`` remembered after the ``seen``-th (the most recent 256)."""
        return [item for n, key, item in list(self.recent) if n > seen and key == domain]

    def culprit(self, domain: str, thread: bool, state: Any) -> Write | None:
        # Only while watching: once stopped, an unseen write may have left the same state.
        if self.count == 0:
            return None
        item = self.last.get((domain, threading.get_ident() if thread else None))
        return item if item is not None and item.after == state else None

    # --- the culprit source the levers and the ledger ask (speedflags.levers.culprits) -----

    def culprit_note(self, lever: Lever, state: Any) -> str:
        """A sentence for a message about ``lever`` found in ``state``: who wrote it, if known."""
        return _note(self.culprit(lever.domain, lever.scope == "thread", state))

    def mixed_note(self, state: Any) -> str:
        """For ``MixedTF32APIError``: the write that made the TF32 state mixed, if known."""
        return _note(tf32_writer(state))

    def torch_write(self, lever: Guard, state: Any) -> str | None:
        """The write of ``lever``'s ``state``, in words, if PyTorch made it by itself."""
        item = self.culprit(lever.domain, lever.scope == "thread", state)
        return item.sentence() if item is not None and item.by_torch is not None else None


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = new_lock()


def _watcher() -> _Watcher:
    global _WATCHER
    if _WATCHER is None:
        with _WATCHER_LOCK:
            if _WATCHER is None:
                _WATCHER = _Watcher()
    return _WATCHER


def _note(item: Write | None) -> str:
    watcher = _WATCHER
    if item is not None:
        return f" Last written by: {item.sentence()}."
    if watcher is None or watcher.count == 0:
        return f" {NOT_WATCHING}"
    return f" {NOT_SEEN}"


def tf32_writer(state: Any) -> Write | None:
    """The write that explains the TF32 family's ``state`` (what made it mixed, if it is)."""
    watcher = _WATCHER
    if watcher is None:
        return None
    last = watcher.culprit(watcher.family, False, state)
    if last is None or family.is_consistent(state):
        return last
    return watcher.mixed_by or last


def _changed(domains: tuple[Domain, ...], befores: list[Any]) -> list[tuple[Domain, Any, Any]]:
    # (domain, before, after) for each domain whose state changed. Out of _learn's try: a
    # filtering comprehension there is a hole in it on Python 3.13
    # (tests/test_exception_table_holes.py).
    return [
        (d, before, after)
        for d, before in zip(domains, befores, strict=True)
        if (after := d.lever.read()) != before
    ]
