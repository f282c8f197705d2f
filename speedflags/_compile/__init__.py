"""``torch.compile`` for ``@speedup(compile=True)`` and ``guard_levers``: fall back to eager
safely, and never run a graph traced under another state of a lever dynamo does not guard.

- :mod:`.guarded`: :class:`~speedflags._compile.guarded.GuardedCompile`, which compiles a
  step and falls back to eager without running a step twice;
- :mod:`.options`: the ``compile=`` argument checked and turned into ``torch.compile``'s;
- :mod:`.backend`: whether the compiler can run here at all (a C compiler, Triton);
- :mod:`.failures`: whether an error is the compiler's (fall back) or the step's (raise it);
- :mod:`.lever_state`: the state of the levers dynamo does not guard, read once per call;
- :mod:`.lever_guard`: graphs kept apart per state of those levers (one artefact per state,
  or compiled again after a change), and their stats;
- :mod:`.user_compile`: :func:`speedflags.guard_levers`, the same for a user's own model.

May import: the ledger (:mod:`speedflags._ledger`) and the base modules; never
``speedup`` or anything above it.
"""
