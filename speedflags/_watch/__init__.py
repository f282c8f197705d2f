"""Who changed a flag: :func:`speedflags.watch` and what it installs.

- :mod:`.watch`: the public ``watch()`` (start/stop, context manager, decorator,
  ``SPEEDFLAGS_WATCH=1``);
- :mod:`.setters`: the ``torch._C`` setters and ``torch.backends`` properties a watch wraps,
  and the frame that made a write;
- :mod:`.watcher`: installs the wrappers, records each external write with its writer's
  ``file:line``, and answers the ledger's and the levers' "who wrote this?".

May import: the ledger (:mod:`speedflags._ledger`), the levers and the base modules.
The layers below learn of a running watch only through the hooks it registers when it
starts (:mod:`speedflags._ledger.own_writes`, :mod:`speedflags.levers.culprits`) and
removes when it stops.
"""
