"""The ledger: every change speedflags makes to torch's flags, and its exact restore.

- :mod:`.ledger`: :class:`~speedflags.FlagLedger` and :func:`~speedflags.ledger`: the hot
  path that opens and closes a frame under one lock, and the public API. The ledger is
  made of parts, each with its own state and one name (module, class, ledger attribute):
- :mod:`.stacks` (``Stacks``, ``ledger.stacks``): the open frames, per domain (stacks) and
  per thread or asyncio task, and the last frame's id;
- :mod:`.ring` (``Ring``, ``ledger.ring``): the history as kept, a ring of compact entries;
- :mod:`.rare_paths` (``RarePaths``, ``ledger.rare_paths``): roll-backs, exits under later
  frames, conflicts;
- :mod:`.recovery` (``Recovery``, ``ledger.recovery``): interrupted exits, threads that
  ended, and the state after a ``fork``.

Below the parts: :mod:`.program` (a frame's levers compiled once), :mod:`.frame`
(:class:`~speedflags.Frame`), :mod:`.history` (the history's entries, with the named fields
of ``Entry``, made by ``entry()``; :class:`~speedflags.FlagRecord`, one lever's view of an
entry; JSON, lever keys, the rank source), :mod:`.notices` (the warnings and errors built
under the lock, spoken after it), :mod:`.own_writes` (which writes are speedflags' own, and
the hook a running :func:`~speedflags.watch` installs at the ledger's boundaries) and
:mod:`.interrupts` (:func:`~speedflags.signal_safe`, deferring signals around a section).
Above them, the frame API, which knows the ledger and a scope through the Protocols of
:mod:`.protocol`: :mod:`.scope` (``with``, ``start``/``stop``, ``@``), :mod:`.entering`
(callers interrupted around an enter or an exit, handled once), :mod:`.decorate` (a scope's
frames around each call, or each step of a generator) and :mod:`.suspend` (what such a
generator's body holds across a ``yield`` or ``await``).

The dynamo primitives that keep the bookkeeping out of graphs are a base module,
:mod:`speedflags._tracing` (the model levers use them too).

The ledger knows levers only through the protocol of :mod:`speedflags.levers._base`, so a
fake lever (a dict) can stand in for torch's in tests. May import: the levers
(:mod:`speedflags.levers`) and the base modules (``errors``, ``hardware``, ``_warn``,
``_short_repr``, ``_version``). It never imports the watch, ``fast_math`` or anything above
them: a running watch reaches the ledger through :mod:`.own_writes` and
:mod:`speedflags.levers.culprits`, hooks it registers.
"""
