"""Measure what each lever buys, with its accuracy cost beside it: ``speedflags bench``.

One measurement engine shared by ``python -m speedflags bench`` and the pytest-benchmark
suites in ``benchmarks/``:

- :mod:`.workloads`: what is timed (matmul, seed 002's train step, SDPA, conv), at which
  sizes, with which configurations;
- :mod:`.problems`: one workload at one size: its FLOP count, inputs from a fixed generator
  and the float64 reference;
- :mod:`.configs`: the lever configurations, each a ``fast_math`` frame on top of a baseline;
- :mod:`.timing`: a synchronising clock, warm-up, rounds, rotation of inputs past the cache;
- :mod:`.accuracy`: relative error against float64, and tolerances;
- :mod:`.runner`: interleaved passes, progress, Ctrl-C;
- :mod:`.results`, :mod:`.table`, :mod:`.plot`: result files, the table, the comparison and
  the speedup-against-error plot;
- :mod:`.output_paths`: the command lines' output files, checked writable before a run.

May import: every layer below the tools (``fast_math``, ``status``, the levers' registry,
``hardware``, ``errors``); of the other tools, ``verify`` (inside a function, to record
verdicts) and ``tune``'s file reader (``bench --config``).
"""
