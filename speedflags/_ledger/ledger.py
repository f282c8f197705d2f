"""The FlagLedger: every lever change goes through here, is recorded, and is undone exactly.

This module holds the hot path (open and close of a frame under one lock) and the public
API; the ledger's parts, each with its own state, are listed in the package's docstring,
and in ``docs/architecture.md`` ("The ledger").
"""

from __future__ import annotations

import threading
from asyncio import current_task as _current_task
from asyncio.events import _get_running_loop
from typing import Any

from .._locks import new_lock
from .._short_repr import short_repr
from .._tracing import Where
from . import history as _history
from . import notices as _notices
from . import own_writes as _own_writes
from . import ring as _ring
from .frame import Frame
from .history import FlagRecord, no_rank
from .history import to_json as _to_json
from .interrupts import PENDING, critical, deliver_pending
from .notices import Notice, conflicts
from .own_writes import _WRITING
from .program import Levers, Program
from .ring import Ring, entry
from .scope import FrameScope
from .stacks import Stacks
from .threads import Threads
from .unwind import Unwind, roll_back

__all__ = ["FlagLedger", "ledger"]

DEFAULT_HISTORY_SIZE = 4096
_get_ident = threading.get_ident
_new_object = object.__new__


class FlagLedger:
    """Applies, records and restores lever changes for a process.

    Use :func:`speedflags.ledger` for the process's ledger: the flags it guards are
    process-wide, so all frames must go through one ledger. Scope: process; its operations
    are thread-safe (one lock), thread-local levers (autocast) are kept per thread, and the
    order in which frames must exit per thread and asyncio task. Closing a frame restores
    each of its levers to the state it found, also when an exception (Ctrl-C) interrupts
    the enter or the exit (``docs/architecture.md``, "Interrupts, signals and fork").

    The frame API: ``frame = ledger.open(levers, label=...)`` ... ``frame.close()``, or
    ``with ledger.frame(levers, label=...) as frame:`` (also ``start()``/``stop()``, ``@``),
    ``levers`` being ``(lever, value)`` pairs (:class:`~speedflags.levers._base.Lever`).

    Example:
        >>> import speedflags
        >>> from speedflags.levers import PROCESS_LEVERS
        >>> the_ledger = speedflags.ledger()
        >>> frame = the_ledger.open([(PROCESS_LEVERS["cudnn_benchmark"], True)], label="demo")
        >>> frame.close()
        >>> [(r.lever, r.action, r.label) for r in the_ledger.history[-2:]]
        [('cudnn_benchmark', 'set', 'demo'), ('cudnn_benchmark', 'restore', 'demo')]

    Args:
        history_size: how many recent records ``history`` keeps (a ring: a training loop
            that enters a frame every step must not grow memory).
    """

    def __init__(self, history_size: int = DEFAULT_HISTORY_SIZE) -> None:
        if type(history_size) is not int or history_size <= 0:  # not a bool either
            raise ValueError(f"history_size={short_repr(history_size)}: expected a positive int")
        # Reentrant: a signal handler entering a block while its thread holds it is refused
        # (LedgerReentryError) instead of waiting forever for itself. Taken with `with` only.
        self._lock = new_lock()
        # Its parts, each with its own state (public for the frame API of this package,
        # which names them in .protocol.FrameLedger; not an API of speedflags): the open
        # frames, the history, the threads that opened frames
        self.stacks = Stacks(self._lock)
        self.ring = Ring(history_size)
        self.threads = Threads(self._lock, self.stacks, self.ring)
        # the parts' containers, bound once for the hot path (the same objects)
        self._by_key = self.stacks.by_key
        self._open = self.stacks.open
        self._context = self.stacks.context
        self._entries = self.ring.entries
        self._known = self.threads.known
        self._gone = self.threads.gone

    # --- frames: the hot path --------------------------------------------------------------

    @critical
    def open(
        self,
        levers: Levers,
        label: str = "",
        where: Where = None,
        owner: object = None,
        device: str | None = None,
    ) -> Frame:
        """Apply ``levers`` as one frame and return it; :meth:`Frame.close` restores them.

        ``levers``: ``(lever, value[, reason])`` items, or a compiled
        :class:`~speedflags._ledger.program.Program` (``fast_math``'s). ``owner`` is what
        the frame is opened for (:meth:`innermost` finds it by that), ``where`` its
        ``(file, line)``. Every state is read and checked before any write; a failure or an
        interruption restores every lever applied: the frame opens whole or not at all.

        The steps, each marked below: (1) who enters (the thread, its task, the rank) and the
        frame; under the lock, (2) the boundary (frames of threads that ended, a watch), (3)
        read and check every domain, changing nothing, (4) push and apply lever by lever,
        (5) record and register the frame; after the lock, (6) speak and deliver. One
        function, not six: the steps run on every block (docs/architecture.md, "The hot
        path"); whatever fails or interrupts (2) to (5) is rolled back by
        :func:`~.unwind.roll_back`.

        Raises:
            MixedTF32APIError: the TF32 APIs disagree (refused before any write).
            LedgerReentryError: this thread is inside the ledger already (a signal handler).
        """
        # (1) who enters, and the frame
        program = levers if type(levers) is Program else Program.of(levers)
        tid = _get_ident()
        if tid in _WRITING:
            self.threads.reentered(label)
        known = self._known.get(tid)  # Known: (token, threading.Thread), read by index here
        if known is None:
            known = self.threads.thread_token(tid)
        loop = _get_running_loop()
        # The frame, made here, whole: Frame has no __init__ (docs/architecture.md, "The hot
        # path"; tests/test_ledger_one_source.py checks that every slot is set)
        frame: Frame = _new_object(Frame)
        frame.id = 0
        frame.ledger = self
        frame.label = label
        frame.owner = owner
        frame.thread_id = tid
        frame.thread = known[1].name
        frame.token = known[0]
        frame.task = None if loop is None else _current_task(loop)  # type: ignore[redundant-expr, unused-ignore]
        frame._where = where
        frame.device = device
        frame.closed = False
        frame.program = program
        rank_source = _history.rank_source
        frame.rank = None if rank_source is no_rank else rank_source()
        befores: list[Any] = [None] * program.n
        afters: list[Any] = [None] * program.n
        frame.befores = befores
        frame.afters = afters
        frame.applied = 0
        stacks = self._by_key
        crowded = False  # a stack held entries already: look for conflicts
        notices: list[Notice] | None = None
        try:
            with self._lock:
                _WRITING.add(tid)
                watched = None
                try:
                    # (2) the boundary: frames of threads that ended; a watch's check
                    if self._gone:
                        notices = self.threads.drop_abandoned(where)
                    # speedflags.watch(): a boundary where changes made around Python are found
                    if _own_writes.WATCHER is not None:
                        watched = _own_writes.enter(self, label, where)
                    part = self.stacks
                    part.last_id = fid = frame.id = part.last_id + 1
                    # (3) read and check every domain: a refusal changes nothing
                    seen = program.seen
                    for i, lever, check, read in program.reads:
                        state = read()
                        # The same state as last time: pass on the object read (and checked)
                        # then. Levers key caches on states (the TF32 family's writes): an
                        # object seen before is found by identity, not by hashing 12 strings.
                        last = seen[i]
                        if state == last:
                            befores[i] = last
                            continue
                        befores[i] = state
                        if check:
                            lever.check(state)  # may refuse: nothing has changed yet
                        seen[i] = state  # last: only a state that passed its check is seen
                    # (4) lever by lever: its stack entry, then its write
                    for i, lever, value, p, key, domain in program.rows:
                        if p < 0:
                            before = befores[i]
                        else:  # the previous lever of its domain hands over the state it left
                            before = befores[i] = afters[p]
                        if key is None:
                            key = (domain, tid)
                        stack = stacks.get(key)
                        if stack is None:
                            stack = self.stacks.new_stack(key)
                        elif stack:
                            crowded = True
                        # Counted, then pushed, then written: a roll-back after any of the three
                        # restores (a no-op before the write), and unlinks what was pushed.
                        frame.applied = i + 1
                        stack.append((frame, i))
                        afters[i] = lever.apply(value, before)
                    # (5) the set records (the ring's entry, appended here: the hot path), the
                    # skips, the open frame, conflicts with other threads' frames, the context
                    n = program.n
                    ring = self.ring
                    ring.seq = seq = ring.seq + n
                    self._entries.append(
                        entry("set", seq - n + 1, _ring.now(), label, fid, frame.thread,
                              frame.rank, where, program.lever_keys, program.reasons,
                              tuple(befores), tuple(afters))
                    )  # fmt: skip
                    if program.skipped:
                        self.ring.skips(frame, where)
                    self._open[fid] = frame
                    if crowded:
                        found = conflicts(self._by_key, frame)
                        if found:
                            notices = found if notices is None else notices + found
                    self.stacks.push(frame)
                    if watched is not None:
                        watched.__exit__(None, None, None)
                except BaseException as exc:  # a failure, or an exception that interrupted us
                    error = roll_back(self.stacks, self.ring, frame, exc, where, watched)
                    if error is not None:
                        raise error  # noqa: B904 - its cause is set
                    raise
                finally:
                    _WRITING.discard(tid)
        except BaseException:  # refused, failed or interrupted: rolled back, lock released
            # signal_safe handlers deferred while entering run now: an interrupt reaches the
            # program on the refusal's way out (or instead of it)
            while True:  # the drain (interrupts.py): no check point after its last test
                if not PENDING:
                    break
                deliver_pending()
            raise
        # (6) what was found under the lock is said now; signal_safe handlers held back run
        if not (notices or PENDING):  # no jump taken on the way out (see deliver_pending)
            return frame
        try:
            if notices:
                _notices.speak(notices)
            while True:  # the drain (interrupts.py): no check point after its last test
                if not PENDING:
                    break
                deliver_pending()
        except BaseException:  # a warning turned into an error, or a handler's exception:
            self.close(frame, where)  # nothing stays entered
            raise
        return frame

    @critical
    def close(self, frame: Frame, where: Where = None) -> None:
        """Restore every lever of ``frame`` (in reverse order, trying each one) and close it.

        Warnings (drift) and errors come once every lever is restored and the lock released;
        an interruption (Ctrl-C) is raised once the exit is done.

        Raises:
            LedgerOrderError: the frame is closed already, another thread's, or not the
                innermost of this thread or task (then closed all the same).
            RestoreError: several levers could not be restored (one failure: raised as is).
            LedgerReentryError: this thread is inside the ledger already (a signal handler).
        """
        tid = _get_ident()
        if tid in _WRITING:
            self.threads.reentered(frame.label)
        notices: list[Notice] | None = None
        unwind: Unwind | None = None  # made by the first lever not simply restored off its top
        with self._lock:
            if frame.closed or frame.thread_id != tid:
                raise self.threads.not_closable(frame)
            _WRITING.add(tid)
            watched = None
            program = frame.program
            n = frame.applied
            found: list[Any] = [None] * n
            restored: list[Any] = [None] * n
            try:
                if self._gone:
                    notices = self.threads.drop_abandoned(where)
                if _own_writes.WATCHER is not None:
                    watched = _own_writes.enter(self, frame.label, where)
                befores, afters, stacks = frame.befores, frame.afters, self._by_key
                rows = program.back if n == program.n else program.rows[:n][::-1]
                for i, lever, _, _, key, domain in rows:
                    try:
                        if key is None:
                            key = (domain, tid)
                        stack = stacks[key]
                        top = stack[-1]
                        current = lever.read()
                        after = afters[i]
                        if current == after:
                            current = after  # the object the lever returned: cheap in its caches
                        found[i] = current
                        if top[0] is frame and top[1] == i:
                            stack.pop()  # an emptied stack stays for the next frame (new_stack)
                            before = befores[i]
                            restored[i] = (
                                lever.restore(before, current) if current != before else current
                            )
                            if current is not after:  # changed inside the block
                                unwind = unwind or Unwind(self.stacks, self.ring, frame, where,
                                                          found, restored)  # fmt: skip
                                unwind.drifted(i, current)
                        else:  # under later frames (or off its stack: an interrupted exit's)
                            unwind = unwind or Unwind(self.stacks, self.ring, frame, where,
                                                      found, restored)  # fmt: skip
                            unwind.buried(i)
                    except BaseException as exc:  # every lever is restored even if one fails
                        unwind = unwind or Unwind(self.stacks, self.ring, frame, where, found,
                                                  restored)  # fmt: skip
                        unwind.failed(i, exc)
                frame.closed = True
                frame.task = None  # a frame kept by the caller must not keep its task alive
                self._open.pop(frame.id, None)
                # the restore records: Ring.closed's entry, appended here (the hot path)
                ring = self.ring
                ring.seq = seq = ring.seq + n
                notes = None if unwind is None else unwind.settle()
                kept = None if notes is None else tuple(notes)
                self._entries.append(
                    entry("restore", seq - n + 1, _ring.now(), frame.label, frame.id,
                          frame.thread, frame.rank, where, program.lever_keys[:n], kept,
                          tuple(found), tuple(restored))
                )  # fmt: skip
                if watched is not None:
                    watched.__exit__(None, None, None)
            except BaseException as exc:  # interrupted in the bookkeeping: finish it first
                unwind = unwind or Unwind(self.stacks, self.ring, frame, where, found, restored)
                unwind.interrupted(exc, watched)
            finally:
                _WRITING.discard(tid)
        frames = self._context.get()  # frame stays there, closed: see Stacks.left
        innermost = None if frames and frames[-1] is frame else self.stacks.left(frames, frame)
        try:
            if notices or unwind is not None or innermost is not None:
                _notices.speak_closed(frame, innermost, notices, unwind, restored)
        finally:  # signal_safe handlers held back while exiting: the drain (interrupts.py)
            while True:  # the drain (interrupts.py): no check point after its last test
                if not PENDING:
                    break
                deliver_pending()

    def frame(self, levers: Levers, *, label: str = "", device: str | None = None) -> FrameScope:
        """``levers`` as a reusable scope on this ledger (:class:`~.scope.FrameScope`):
        ``with``, ``async with``, ``start()``/``stop()``, or ``@scope`` on a function.

        Example:
            >>> import torch, speedflags
            >>> from speedflags.levers import PROCESS_LEVERS
            >>> with speedflags.ledger().frame([(PROCESS_LEVERS["cudnn_benchmark"], True)]):
            ...     torch.backends.cudnn.benchmark
            True
        """
        return FrameScope(levers, label=label, device=device, ledger=self)

    @property
    def history(self) -> tuple[FlagRecord, ...]:
        """The most recent records (at most ``history_size``), oldest first (a copy)."""
        with self._lock:
            return self.ring.records()

    def clear_history(self) -> None:
        """Forget the recorded history (open frames and their restore data are kept)."""
        with self._lock:
            self.ring.clear()

    def to_json(self, indent: int | None = None) -> str:
        """The history as JSON, with the PyTorch and speedflags versions and the process id."""
        return _to_json(self.history, indent)

    def note(
        self,
        lever: str,
        action: str,
        reason: str,
        *,
        before: Any = None,
        after: Any = None,
        label: str = "",
        where: Where = None,
    ) -> FlagRecord:
        """Append an event that is not a frame (a heal, a compile fallback, a write seen by
        ``watch``) to the history, with this thread's name and the process's rank."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            # Held already (a watch's boundary notes inside an open): not taken a second
            # time. On Python 3.10 an interrupt landing while a nested `with` unwinds can skip
            # its release, leaving the lock held after the outer block let go of it.
            return self.ring.note(lever, action, reason, before, after, label, where)
        with self._lock:
            return self.ring.note(lever, action, reason, before, after, label, where)

    def open_frames(self) -> tuple[Frame, ...]:
        """Every frame open now, in all threads and tasks, in order of entry."""
        with self._lock:
            return tuple(self._open.values())

    def innermost(self, owner: object) -> Frame:
        """The innermost open frame entered through ``owner`` in this task (or thread).

        Raises:
            LedgerOrderError: ``owner`` has no open frame here.
        """
        return self.stacks.innermost(owner)

    @property
    def lock(self) -> Any:
        """The ledger's (reentrant) lock: held, no other thread opens or closes a frame.
        Take it with ``with`` only, around writes to torch state outside a frame:

        Example:
            >>> import speedflags
            >>> the_ledger = speedflags.ledger()
            >>> with the_ledger.lock, the_ledger.section("my repair"):
            ...     pass  # writes here are speedflags' own to watch()
        """
        return self._lock

    def section(self, label: str, where: Where = None) -> Any:
        """Around speedflags' own writes outside a frame (holding :attr:`lock`): ``watch()``
        takes them as speedflags' own and reports changes found before it."""
        return _own_writes.section(self, label, where)

    def __repr__(self) -> str:
        return f"<FlagLedger: {len(self.ring)} entries, {len(self.open_frames())} open frames>"

    def _forget_frames(self) -> None:
        # For tests that left frames open: drop them everywhere, restoring nothing.
        with self._lock:
            self.stacks.forget()


_PROCESS_LEDGER = FlagLedger()


def ledger() -> FlagLedger:
    """The process's :class:`FlagLedger` (all speedflags frames go through it).

    Scope: process. Reading it changes nothing.

    Example:
        >>> import speedflags
        >>> speedflags.ledger() is speedflags.ledger()
        True
    """
    return _PROCESS_LEDGER
