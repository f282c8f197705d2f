"""The lever registry: every lever ``fast_math`` knows, in the order they are applied.

Adding a lever means one new module here and one line in :data:`PROCESS_LEVERS` (or a
factory like :func:`autocast_lever` for per-device levers).
"""

from __future__ import annotations

import threading

from ._base import Effect, Lever, Unreadable
from .autocast import AutocastLever
from .cudnn import CudnnBenchmarkLever
from .precision import MatmulPrecisionLever
from .sdpa import SdpaLever
from .tf32 import TF32Lever

__all__ = [
    "LEVER_NAMES",
    "PROCESS_LEVERS",
    "Effect",
    "Lever",
    "Unreadable",
    "autocast_lever",
]

# Application order: TF32 before matmul precision (they share state and both are checked
# for a mixed TF32 state first), autocast last.
LEVER_NAMES = ("tf32", "matmul_precision", "cudnn_benchmark", "sdpa", "amp")

PROCESS_LEVERS: dict[str, Lever] = {
    "tf32": TF32Lever(),
    "matmul_precision": MatmulPrecisionLever(),
    "cudnn_benchmark": CudnnBenchmarkLever(),
    "sdpa": SdpaLever(),
}

_autocast: dict[str, AutocastLever] = {}
_autocast_lock = threading.Lock()


def autocast_lever(device_type: str) -> AutocastLever:
    """The ``amp`` lever for one device type (one shared instance per type)."""
    lever = _autocast.get(device_type)
    if lever is None:
        with _autocast_lock:
            lever = _autocast.setdefault(device_type, AutocastLever(device_type))
    return lever
