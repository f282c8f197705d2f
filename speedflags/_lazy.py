"""The names ``speedflags`` loads on first use (PEP 562), and the old spellings that still work.

Most programs only enter blocks: the tools, the status readers, the rank check, the watch and
the training helpers load when a program first touches them. The package's ``__getattr__``
and ``__dir__`` hand over to :func:`load` and :func:`names`; this module itself loads with
the first such name, not with ``import speedflags``.

A name used inside a function torch.compile traces must not be here: PyTorch 2.1's dynamo
reads a module's ``__dict__`` and never calls its ``__getattr__``. Those stay imported by
the package's ``__init__``.

Example:
    >>> import speedflags
    >>> from speedflags._lazy import LAZY
    >>> LAZY["tune"], speedflags.tune is speedflags._tune.tune
    ('._tune', True)
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module
from typing import Any

__all__ = ["LAZY", "MODULES", "MOVED", "load", "names"]

PACKAGE = "speedflags"

# public name -> the module, relative to the package, that defines it
LAZY: dict[str, str] = {
    "bench": ".bench",  # a module, as users and benchmarks/ import it
    "report": ".report",  # a module: speedflags report
    "load_levers": "._measure.lever_files",
    "verify": "._measure.verdicts",
    "Verification": "._measure.verification",
    "check_ranks": "._distributed",
    "RankSnapshot": "._distributed",
    "guard_levers": "._compile.user_compile",
    "lever": "._fast_math.own_lever",
    "OwnLever": "._fast_math.own_lever",
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
MODULES = ("bench", "report", "training")  # the names in LAZY that are modules themselves

# Old spellings that still work, with a DeprecationWarning (not in __all__ or dir()):
# name -> (the module that defines it, what to write instead).
MOVED: dict[str, tuple[str, str]] = {
    "fast_optimizer": (".training", "speedflags.training.fast_optimizer"),
    "grad_scaler": (".training", "speedflags.training.grad_scaler"),
    "to_device": (".training", "speedflags.training.to_device"),
    "UNSET": (".levers._base", "None, or leave the keyword out (both leave a lever unchanged)"),
}


def load(name: str) -> Any:
    """The package's ``__getattr__``: import what defines ``name`` and bind it on the package.

    An old spelling warns and is not bound, so that it warns at each use; an unknown name
    is an ``AttributeError`` naming it.

    Example:
        >>> from speedflags._lazy import load
        >>> load("training").__name__
        'speedflags.training'
    """
    moved = MOVED.get(name)
    if moved is not None:
        # stacklevel 3: the user's line, past the package's __getattr__ and this function
        warnings.warn(
            f"{PACKAGE}.{name} is deprecated; use {moved[1]}", DeprecationWarning, stacklevel=3
        )
        return getattr(import_module(moved[0], PACKAGE), name)
    if name not in LAZY:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    module = import_module(LAZY[name], PACKAGE)
    if name in MODULES:
        return module  # the import system has bound it on the package already
    value = getattr(module, name)
    # an ordinary attribute from now on: the next lookup never reaches __getattr__
    vars(sys.modules[PACKAGE])[name] = value
    return value


def names() -> list[str]:
    """The package's ``__dir__``: what it has bound, and every name it loads on first use.

    Example:
        >>> from speedflags._lazy import names
        >>> "tune" in names() and "UNSET" not in names()
        True
    """
    return sorted(set(vars(sys.modules[PACKAGE])) | set(LAZY))
