"""``torch.compile`` for ``@speedup(compile=True)``: compile once, fall back to eager safely.

- :mod:`.guarded`: :class:`~speedflags.compile.guarded.GuardedCompile`, which compiles a
  step and falls back to eager without running a step twice;
- :mod:`.options`: the ``compile=`` argument checked and turned into ``torch.compile``'s;
- :mod:`.backend`: whether the compiler can run here at all (a C compiler, Triton);
- :mod:`.failures`: whether an error is the compiler's (fall back) or the step's (raise it).

May import: the ledger (:mod:`speedflags.flag_ledger`) and the base modules; never
``speedup`` or anything above it.
"""
