"""The ``cudnn_benchmark`` lever: ``torch.backends.cudnn.benchmark`` and nothing else.

PyTorch's own ``torch.backends.cudnn.flags(benchmark=True)`` also applies its other
defaults (``enabled=False`` among them), silently switching cuDNN off; this lever writes the
one flag through ``torch._C`` and leaves ``enabled``, ``deterministic`` and TF32 alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._C as torch_C

from .._hardware import capabilities, cudnn_available
from ._base import Effect, SimpleLever, validate_bool
from .deterministic import refuse_nested
from .spec import ON_OFF, Shorthand, declare

_C: Any = torch_C  # by its module: PyTorch 2.1's stubs do not re-export torch._C


class CudnnBenchmarkLever(SimpleLever):
    """``cudnn_benchmark=True/False``: let cuDNN time its convolution algorithms per shape.

    Scope: process. Restores the previous ``torch.backends.cudnn.benchmark`` value.
    """

    name = "cudnn_benchmark"
    scope = "process"
    domain = "cudnn_benchmark"

    validate = staticmethod(validate_bool)

    def read(self) -> bool:
        return bool(_C._get_cudnn_benchmark())

    # One plain setter: the value written is the value read back, so no read-back is spent.
    def apply(self, value: bool, before: bool) -> bool:
        if before != value:
            # deterministic=True (not its warn-only mode) on: refused as in one spec
            if (
                value
                and _C._get_deterministic_algorithms()
                and not _C._get_deterministic_algorithms_warn_only()
            ):
                refuse_nested(
                    "cudnn_benchmark=True",
                    "deterministic algorithms are on",
                    "leave cudnn_benchmark out of the inner block",
                )
            _C._set_cudnn_benchmark(value)
        return value

    def restore(self, target: bool, current: bool) -> bool:
        if current != target:
            _C._set_cudnn_benchmark(target)
        return target

    def available(self, value: bool, device: torch.device) -> Effect:
        if device.type != "cuda":
            return Effect(False, f"no effect on {device}: cuDNN autotuning is for CUDA devices")
        if not cudnn_available():
            caps = capabilities(device)
            why = caps.fp16.reason if not torch.cuda.is_available() else "cuDNN is not available"
            return Effect(False, f"no effect on {caps.device}: {why}")
        return Effect(True, "")


CUDNN_BENCHMARK_SHORTHAND = Shorthand(
    name="cudnn_benchmark",
    parameter="enabled",
    default=True,
    doc="""``torch.backends.cudnn.benchmark`` for a block, and nothing else.

    Scope: process. Restores the previous ``benchmark`` value; ``enabled``,
    ``deterministic`` and TF32 are never touched.

    Example:
        >>> import torch, speedflags
        >>> with speedflags.cudnn_benchmark():
        ...     torch.backends.cudnn.benchmark
        True
    """,
)


DECLARED = (
    declare(
        CudnnBenchmarkLever(),
        shorthand=CUDNN_BENCHMARK_SHORTHAND,
        **ON_OFF,
        order=30,
        summary="cuDNN times its convolution algorithms per input shape",
        accuracy="none in principle; the chosen algorithm may differ run to run",
        ops=("conv",),
        dynamo_misses="all of it",
    ),
)
