"""speedflags: PyTorch's Tensor Core fast paths, switched on safely and restored exactly.

Every lever (TF32, matmul precision, cuDNN benchmark, SDPA kernels, deterministic
algorithms, cuBLAS reduced-precision reductions, autocast) is a reversible context manager
and decorator built on one :class:`FlagLedger`, which records the state before and after
each change, restores it exactly, and refuses to mix PyTorch's legacy and new TF32 APIs.

Importing it loads the levers, the ledger and the blocks; the tools (``tune``, ``verify``,
``speedflags.bench``, ``speedflags.report``, ``watch``, ...) load when first used.

Example:
    >>> import torch, speedflags
    >>> with speedflags.fast_math(tf32=True, amp="bf16", device="cpu"):
    ...     y = torch.ones(4, 4) @ torch.ones(4, 4)
    >>> y.dtype
    torch.bfloat16
"""

import os as _os
import sys as _sys
import typing as _typing
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

# Loaded at import: the levers, the ledger and the blocks users write. A name used inside a
# function torch.compile traces must be here: PyTorch 2.1's dynamo reads a module's
# __dict__ and never calls its __getattr__, so a name loaded on first use would fail there.
from . import errors
from ._fast_math import FastMath, fast_math
from ._hardware import Capabilities, Capability, capabilities
from ._ledger.frame import Frame
from ._ledger.history import FlagRecord
from ._ledger.interrupts import signal_safe
from ._ledger.ledger import FlagLedger, ledger
from ._ledger.scope import FrameScope
from ._short_repr import set_module as _set_module
from ._shorthands import (
    autocast,
    cudnn_benchmark,
    deterministic,
    matmul_precision,
    reduced_precision_reduction,
    sdpa_backend,
    tf32,
)
from ._speedup import speedup
from ._version import __version__
from .errors import *  # noqa: F403 - the exceptions and warnings, named once in errors.__all__
from .levers import Unreadable, register_lever, unregister_lever

if _typing.TYPE_CHECKING:  # the names loaded on first use (_lazy.py), as type checkers see them
    from . import bench as bench
    from . import report as report
    from . import training as training
    from ._compile.user_compile import guard_levers
    from ._distributed import RankSnapshot, check_ranks
    from ._fast_math.own_lever import OwnLever, lever
    from ._measure.lever_files import load_levers
    from ._measure.verdicts import verify
    from ._measure.verification import Verification
    from ._recommend import Recommendation, recommended
    from ._schedule import Schedule, TF32Schedule
    from ._speedup_stats import SpeedupStats
    from ._status import TF32Status, heal_tf32, snapshot, tf32_status
    from ._tune import tune
    from ._tune.result import TuneResult
    from ._watch.watch import watch

__all__ = [
    "Capabilities",
    "Capability",
    "FastMath",
    "FlagLedger",
    "FlagRecord",
    "Frame",
    "FrameScope",
    "OwnLever",
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
    "guard_levers",
    "heal_tf32",
    "ledger",
    "lever",
    "load_levers",
    "matmul_precision",
    "recommended",
    "reduced_precision_reduction",
    "register_lever",
    "sdpa_backend",
    "signal_safe",
    "snapshot",
    "speedup",
    "tf32",
    "tf32_status",
    "tune",
    "unregister_lever",
    "verify",
    "watch",
]
__all__ += errors.__all__


# The other public classes carry @set_module("speedflags") at their definition; these are
# defined where it is not written yet (_ledger/, _fast_math/).
for _public_class in (FastMath, FlagLedger, FlagRecord, Frame, FrameScope):
    _set_module(__name__)(_public_class)


if not _typing.TYPE_CHECKING:  # type checkers read the names from the imports above instead

    def __getattr__(name: str) -> _typing.Any:
        # the names loaded on first use and the old spellings (_lazy.py, loaded by the first)
        from ._lazy import load

        return load(name)


def __dir__() -> list[str]:
    from ._lazy import names

    return names()


if _os.environ.get("SPEEDFLAGS_WATCH"):  # watch from the first import on, for the whole process
    from ._watch.watch import start_from_env as _start_from_env

    _start_from_env()
    del _start_from_env

del _public_class, _set_module, _numpy_missing
