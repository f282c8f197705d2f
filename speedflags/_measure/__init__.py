"""What ``bench``, ``tune`` and ``verify`` share: how speedflags measures, in one place.

Each of the three tools imports this package and the layers below it, never one another,
and nothing here imports a tool (``tests/test_package_layers.py`` checks both):

- time: :mod:`.timing` (a clock that waits for the device, rounds sized from a warm-up,
  input sets rotated past the cache), :mod:`.rounds` (warm-up and timed rounds of a runner);
- what is timed: :mod:`.workloads` (which problems, at which sizes, with which
  configurations), :mod:`.problems` (inputs, FLOP count, float64 reference, the timed call),
  :mod:`.configs` (a lever configuration: a ``fast_math`` frame on top of the baseline),
  :mod:`.accuracy` (relative error against float64, tolerances);
- whether a lever takes effect: :mod:`.verdicts` (``verify()``: enter each lever value,
  probe it, judge it; ``recorded()`` keeps the verdicts in bench and tune results),
  :mod:`.verification` (``Verdict``, ``Verification``), :mod:`.probes` and
  :mod:`.probe_reductions` (one measurement per lever), :mod:`.evidence` (inputs, error
  levels, the operators and kernels that ran), :mod:`.causes` (why a lever is not in
  effect), :mod:`.route` (what ``matmul_precision="medium"`` does on this CPU, found by
  trying; the effect every tool reads);
- saying it honestly: :mod:`.vocabulary` (the one set of words every tool says a lever's
  effect with, "in effect, emulated: slower" among them), :mod:`.noise` (paired-pass
  speedups, their noise, whether a difference is within it), :mod:`.emulation` (what an
  emulated lever costs, timed on a small matmul);
- files: :mod:`.lever_files` (lever files: ``load_levers``, JSON, TOML, YAML),
  :mod:`.output_paths` (output files checked before a run), :mod:`.plot_axes` (the
  speedup-against-error axes).

May import: the layers below the tools (``fast_math``, ``status``, the levers' registry,
``hardware``, ``errors``, the base helpers); never ``bench``, ``tune``, ``verify`` or
anything above them. It works through ``fast_math`` frames like any user, never through the
ledger's or the watch's modules.
"""
