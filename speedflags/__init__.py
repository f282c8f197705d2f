"""speedflags: PyTorch's Tensor Core fast paths, switched on safely and restored exactly.

Every lever (TF32, matmul precision, cuDNN benchmark, SDPA kernels, deterministic
algorithms, cuBLAS reduced-precision reductions, autocast) is a reversible context manager
and decorator built on one :class:`FlagLedger`, which records the state before and after
each change, restores it exactly, and refuses to mix PyTorch's legacy and new TF32 APIs.

Example:
    >>> import torch, speedflags
    >>> with speedflags.fast_math(tf32=True, amp="bf16", device="cpu"):
    ...     y = torch.ones(4, 4) @ torch.ones(4, 4)
    >>> y.dtype
    torch.bfloat16
"""

import sys as _sys
import warnings as _warnings
from importlib.util import find_spec as _find_spec


def _numpy_missing() -> bool:
    try:
        return _find_spec("numpy") is None
    except (ImportError, ValueError):  # a None in sys.modules: imports of numpy fail
        return True


if "torch" not in _sys.modules and _numpy_missing():
    # Without NumPy, importing torch warns "Failed to initialize NumPy". speedflags never
    # uses NumPy, and the warning would open the output of every `speedflags` command (which
    # imports torch through this package). Only that warning, only when NumPy is absent: a
    # NumPy that is there but broken keeps its warning.
    with _warnings.catch_warnings():
        _warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        import torch  # noqa: F401

from . import errors
from ._version import __version__
from .compile.user_compile import guard_levers
from .distributed import RankSnapshot, check_ranks
from .errors import *  # noqa: F403 - the exceptions and warnings, named once in errors.__all__
from .fast_math import FastMath, fast_math
from .flag_ledger.history import FlagRecord
from .flag_ledger.interrupts import signal_safe
from .flag_ledger.ledger import FlagLedger, ledger
from .flag_ledger.program import Frame
from .hardware import Capabilities, Capability, capabilities
from .levers import Unreadable
from .levers._unset import UNSET
from .recommend import Recommendation, recommended
from .schedule import Schedule, TF32Schedule
from .shorthands import (
    autocast,
    cudnn_benchmark,
    deterministic,
    matmul_precision,
    reduced_precision_reduction,
    sdpa_backend,
    tf32,
)
from .speedup import SpeedupStats, speedup
from .status import TF32Status, heal_tf32, snapshot, tf32_status
from .training import fast_optimizer, grad_scaler, to_device
from .tune import TuneResult, load_levers, tune
from .verify import Verification, verify
from .watching.watch import start_from_env as _start_from_env
from .watching.watch import watch

__all__ = [
    "UNSET",
    "Capabilities",
    "Capability",
    "FastMath",
    "FlagLedger",
    "FlagRecord",
    "Frame",
    "RankSnapshot",
    "Recommendation",
    "Schedule",
    "SpeedupStats",
    "TF32Schedule",
    "TF32Status",
    "TuneResult",
    "Unreadable",
    "Verification",
    "__version__",
    "autocast",
    "capabilities",
    "check_ranks",
    "cudnn_benchmark",
    "deterministic",
    "fast_math",
    "fast_optimizer",
    "grad_scaler",
    "guard_levers",
    "heal_tf32",
    "ledger",
    "load_levers",
    "matmul_precision",
    "recommended",
    "reduced_precision_reduction",
    "sdpa_backend",
    "signal_safe",
    "snapshot",
    "speedup",
    "tf32",
    "tf32_status",
    "to_device",
    "tune",
    "verify",
    "watch",
]
__all__ += errors.__all__

# Public classes say where users find them: <speedflags.FastMath ...>, not a private module.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj, _numpy_missing

# SPEEDFLAGS_WATCH=1: watch from the first import on, for the whole process
_start_from_env()
