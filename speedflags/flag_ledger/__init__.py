"""The ledger: every change speedflags makes to torch's flags, and its exact restore.

- :mod:`.ledger`: :class:`~speedflags.FlagLedger` and :func:`~speedflags.ledger`, the hot
  path that opens and closes a frame under one lock;
- :mod:`.paths`: the same off the hot path (out-of-order and buried exits, drift, conflicts,
  frames per thread and per asyncio task);
- :mod:`.recovery`: roll-backs, abandoned frames, and the state after a ``fork``;
- :mod:`.program`: a frame's levers compiled once (:class:`~speedflags.Frame`);
- :mod:`.history`: :class:`~speedflags.FlagRecord` and the history ring;
- :mod:`.notices`: the warnings and errors built under the lock, spoken after it;
- :mod:`.own_writes`: which writes are speedflags' own, and the hook a running
  :func:`~speedflags.watch` installs at the ledger's boundaries;
- :mod:`.interrupts`: :func:`~speedflags.signal_safe`, deferring signals around a section;
- :mod:`.decorate`: turning "open a frame / close a frame" into a decorator.

May import: the levers (:mod:`speedflags.levers`) and the base modules (``errors``,
``hardware``, ``_warn``, ``_short_repr``, ``_version``). It never imports the
watch, ``fast_math`` or anything above them: a running watch reaches the ledger through
:mod:`.own_writes` and :mod:`speedflags.levers.culprits`, hooks it registers.
"""
