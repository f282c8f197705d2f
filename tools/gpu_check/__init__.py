"""``make gpu-check``: the harness that runs the project's own suite, ``verify``, the
benchmarks and ``bench`` on a GPU machine and writes one summary (``docs/gpu_check.md``).

It drives the repository (its tests, benchmarks and command line), so it lives beside them,
not in the installed package: :mod:`.check` (the driver, ``python -m tools.gpu_check``),
:mod:`.steps` (what each step runs), :mod:`.machine` (what it records of the machine),
:mod:`.summary` with :mod:`.sections` (``summary.md``) and :mod:`.peaks` (the GPUs' dense
datasheet peaks, which ``benchmarks/fp8_headroom.py`` reads too).
"""
