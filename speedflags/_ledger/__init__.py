"""The ledger: every change speedflags makes to torch's flags, and its exact restore.

- :mod:`.ledger`: :class:`~speedflags.FlagLedger` and :func:`~speedflags.ledger`: the hot
  path that opens and closes a frame under one lock, and the public API. The ledger is
  made of parts, each with its own state:
- :mod:`.stacks`: the open frames, per domain (stacks) and per thread or asyncio task;
- :mod:`.history`: the history ring, :class:`~speedflags.FlagRecord` and JSON;
- :mod:`.paths`: the rare paths (roll-backs, exits under later frames, conflicts);
- :mod:`.recovery`: interrupted exits, threads that ended, and the state after a ``fork``;
- :mod:`.program`: a frame's levers compiled once, and :class:`~speedflags.Frame`;
- :mod:`.scope`: the frame API's context form (``with``, ``start``/``stop``, ``@``);
- :mod:`.entering`: callers interrupted around an enter or an exit, handled once;
- :mod:`.decorate`: a scope's frames around each call, or each step of a generator;
- :mod:`.suspend`: what such a generator's body holds across a ``yield`` or ``await``;
- :mod:`.notices`: the warnings and errors built under the lock, spoken after it;
- :mod:`.own_writes`: which writes are speedflags' own, and the hook a running
  :func:`~speedflags.watch` installs at the ledger's boundaries;
- :mod:`.interrupts`: :func:`~speedflags.signal_safe`, deferring signals around a section.

The dynamo primitives that keep the bookkeeping out of graphs are a base module,
:mod:`speedflags._tracing` (the model levers use them too).

The ledger knows levers only through the protocol of :mod:`speedflags.levers._base`, so a
fake lever (a dict) can stand in for torch's in tests. May import: the levers
(:mod:`speedflags.levers`) and the base modules (``errors``, ``hardware``, ``_warn``,
``_short_repr``, ``_version``). It never imports the watch, ``fast_math`` or anything above
them: a running watch reaches the ledger through :mod:`.own_writes` and
:mod:`speedflags.levers.culprits`, hooks it registers.
"""
