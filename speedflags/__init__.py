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
from importlib import import_module as _import_module
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
from ._ledger.history import FlagRecord
from ._ledger.interrupts import signal_safe
from ._ledger.ledger import FlagLedger, ledger
from ._ledger.program import Frame
from ._ledger.scope import FrameScope
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

if _typing.TYPE_CHECKING:  # the names loaded on first use (_LAZY), as type checkers see them
    from . import bench as bench
    from . import report as report
    from . import training as training
    from ._compile.user_compile import guard_levers
    from ._distributed import RankSnapshot, check_ranks
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

# Loaded on first use (PEP 562): public name -> the module, relative to this package, that
# defines it. Most programs only enter blocks; the tools, the status readers, the rank check,
# the watch and the training helpers load when a program first touches them.
_LAZY: dict[str, str] = {
    "bench": ".bench",  # a module, as users and benchmarks/ import it
    "report": ".report",  # a module: speedflags report
    "load_levers": "._measure.lever_files",
    "verify": "._measure.verdicts",
    "Verification": "._measure.verification",
    "check_ranks": "._distributed",
    "RankSnapshot": "._distributed",
    "guard_levers": "._compile.user_compile",
    "Recommendation": "._recommend",
    "recommended": "._recommend",
    "SpeedupStats": "._speedup_stats",
    "Schedule": "._schedule",
    "TF32Schedule": "._schedule",
    "TF32Status": "._status",
    "heal_tf32": "._status",
    "snapshot": "._status",
    "tf32_status": "._status",
    "training": ".training",  # a module: the training helpers (fast_optimizer, ...)
    "tune": "._tune",
    "TuneResult": "._tune.result",
    "watch": "._watch.watch",
}
_MODULES = ("bench", "report", "training")  # the lazy names that are modules themselves
# Old spellings that still work, with a DeprecationWarning (not in __all__ or dir()):
# name -> (the module that defines it, what to write instead).
_MOVED: dict[str, tuple[str, str]] = {
    "fast_optimizer": (".training", "speedflags.training.fast_optimizer"),
    "grad_scaler": (".training", "speedflags.training.grad_scaler"),
    "to_device": (".training", "speedflags.training.to_device"),
    "UNSET": (".levers._base", "None, or leave the keyword out (both leave a lever unchanged)"),
}

__all__ = [
    "Capabilities",
    "Capability",
    "FastMath",
    "FlagLedger",
    "FlagRecord",
    "Frame",
    "FrameScope",
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


def _publish(name: str, value: _typing.Any) -> _typing.Any:
    # Public classes say where users find them: <speedflags.FastMath ...>, not a private module.
    if isinstance(value, type) and name in __all__:
        value.__module__ = __name__
    globals()[name] = value
    return value


for _name in __all__:
    if _name not in _LAZY:
        _publish(_name, globals()[_name])


if not _typing.TYPE_CHECKING:  # type checkers read the names from the imports above instead

    def __getattr__(name: str) -> _typing.Any:
        moved = _MOVED.get(name)
        if moved is not None:
            _warnings.warn(
                f"speedflags.{name} is deprecated; use {moved[1]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(_import_module(moved[0], __name__), name)
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = _import_module(_LAZY[name], __name__)
        if name in _MODULES:
            return module
        value = _publish(name, getattr(module, name))
        # What that import loaded is public as well now: a TuneResult that speedflags.tune()
        # returns reports speedflags.TuneResult before anyone asks for the class.
        for other, where in _LAZY.items():
            if other not in globals() and other not in _MODULES:
                loaded = _sys.modules.get(__name__ + where)
                if loaded is not None and hasattr(loaded, other):
                    _publish(other, getattr(loaded, other))
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if _os.environ.get("SPEEDFLAGS_WATCH"):  # watch from the first import on, for the whole process
    from ._watch.watch import start_from_env as _start_from_env

    _start_from_env()
    del _start_from_env

del _name, _numpy_missing
