"""The ledger: every change speedflags makes to torch's flags, and its exact restore.

:class:`~speedflags.FlagLedger` (:mod:`.ledger`) opens and closes frames under one lock and
serves the public API. It is made of three parts, each holding its own state and named
alike in its module, its class and the ledger's attribute: :mod:`.stacks` (``Stacks``, the
open frames: by id, per domain, per thread or asyncio task), :mod:`.ring` (``Ring``, the
history as kept) and :mod:`.threads` (``Threads``, the threads that opened frames and those
that ended). What each structure holds, which one is the truth for what, and what may lag
behind: ``docs/architecture.md``, "The ledger's invariants".

Below the parts: :mod:`.program` (a frame's levers compiled once), :mod:`.frame`
(:class:`~speedflags.Frame`), :mod:`.history` (:class:`~speedflags.FlagRecord`, JSON, lever
keys, the rank source), :mod:`.notices` (warnings and errors built under the lock, spoken
after it), :mod:`.unwind` (a frame's levers taken off their stacks other than by the hot
close: roll-backs, exits under later frames or interrupted, abandoned frames),
:mod:`.own_writes` (which writes are speedflags' own; the watch's hook) and
:mod:`.interrupts` (:func:`~speedflags.signal_safe`, critical code, the drain of held-back
handlers). Above them, the frame API, which knows the ledger and a scope through the
Protocols of :mod:`.protocol`: :mod:`.scope` (``with``, ``start``/``stop``, ``@``),
:mod:`.entering` (callers interrupted around an enter or an exit), :mod:`.decorate` (a
scope's frames around each call or step) and :mod:`.suspend` (what a decorated generator's
body holds across a ``yield`` or ``await``).

The ledger knows levers only through the protocol of :mod:`speedflags.levers._base` (a fake
lever over a dict stands in for torch's in tests). May import: the levers and the base
modules; never the watch, ``fast_math`` or anything above them: a running watch reaches the
ledger through :mod:`.own_writes` and :mod:`speedflags.levers.culprits`, hooks it registers.
"""
