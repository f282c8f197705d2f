"""``speedflags.verify``: proof that each lever took effect, measured on the device.

A lever can read as on and still do nothing: ``NVIDIA_TF32_OVERRIDE=0`` keeps cuBLAS off
TF32 while ``allow_tf32`` reads True, cuDNN may be disabled, an SDPA kernel may refuse the
inputs and leave the math fallback to run. :func:`verify` enters each lever through
``fast_math`` and measures it (errors against float64, output dtypes, operators and kernels
that ran, the autotuner's trial kernels), one :class:`Verdict` per lever value in a
:class:`Verification`.

Modules: :mod:`.check` (``verify``), :mod:`.probes` (one measurement per lever),
:mod:`.measure` (inputs, error levels, dispatch and profiler recording), :mod:`.causes` (why a
lever is not in effect), :mod:`.result` (verdicts, table, JSON), :mod:`.cli` (``python -m
speedflags verify``), and for ``make gpu-check``: :mod:`.gpu_check` (the driver),
:mod:`.summary` and :mod:`.peaks`.

What this subpackage may import: torch, and speedflags' public modules (``fast_math``,
``status``, ``hardware``, ``errors``, ``levers.registry``, ``bench``, ``tune``). Never the
ledger's modules (:mod:`speedflags.flag_ledger`), the watch (:mod:`speedflags.watching`),
compile (:mod:`speedflags.compile`) or the rank check's internals: it works through
``fast_math`` frames like any user. ``bench`` and ``tune``
import it only inside functions (to record verdicts), so no import cycle arises.
"""

from .check import verify
from .result import Verdict, Verification

__all__ = ["Verdict", "Verification", "verify"]
