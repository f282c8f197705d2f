"""``speedflags.verify``: proof that each lever took effect, measured on the device.

A lever can read as on and still do nothing: ``NVIDIA_TF32_OVERRIDE=0`` keeps cuBLAS off
TF32 while ``allow_tf32`` reads True, cuDNN may be disabled, an SDPA kernel may refuse the
inputs and leave the math fallback to run. :func:`verify` enters each lever through
``fast_math`` and measures it (errors against float64, output dtypes, operators and kernels
that ran, the autotuner's trial kernels), one :class:`Verdict` per lever value in a
:class:`Verification`.

The measuring is shared with ``bench`` and ``tune`` (their results carry the verdicts) and
lives in :mod:`speedflags._measure`: :mod:`~speedflags._measure.verdicts` (``verify``),
:mod:`~speedflags._measure.probes` (one measurement per lever),
:mod:`~speedflags._measure.evidence` (inputs, error levels, dispatch and profiler
recording), :mod:`~speedflags._measure.causes` (why a lever is not in effect),
:mod:`~speedflags._measure.verification` (verdicts, table, JSON). Here: :mod:`.cli`
(``python -m speedflags verify``). ``make gpu-check``, which runs ``verify`` among the
project's own tests and benchmarks on a GPU machine, is the repository's (``tools/gpu_check/``),
not the installed package's.

May import: :mod:`speedflags._measure` and the layers below the tools (``fast_math``,
``status``, ``hardware``, ``errors``, ``levers.registry``); never ``bench`` or ``tune``,
nor the ledger's modules (:mod:`speedflags._ledger`), the watch
(:mod:`speedflags._watch`), compile (:mod:`speedflags._compile`) or the rank check's
internals: it works through ``fast_math`` frames like any user.
"""

from .._measure.verdicts import verify
from .._measure.verification import Verdict, Verification

__all__ = ["Verdict", "Verification", "verify"]
