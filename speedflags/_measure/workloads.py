"""The workloads: which problems are timed, at which sizes, with which configurations.

A :class:`Workload` names a kind of work and the configurations compared on it; for one
size on one device it builds a :class:`~speedflags._measure.problems.Problem` (inputs, FLOP
count, float64 reference, one :class:`~speedflags._measure.problems.Runner` per configuration).

=============  ===========================================================================
``matmul``     ``a @ b``, n x n float32 (size: n)
``mlp-train``  the 3×Linear(d, d) AdamW train step: ``Linear(d, d)`` x3 with GELU, batch
               ``min(512, d)``; forward, MSE loss, backward and an AdamW step; with ``fp8``
               as ``@speedup`` enters it, alone and with bf16 autocast (size: d)
``sdpa``       ``scaled_dot_product_attention`` with each backend (size: sequence length)
``conv``       a 3x3 ``conv2d``, with and without ``cudnn_benchmark``; CUDA only
               (size: height = width)
``linear-``    weight-bound inference, ``Linear(d, d)`` x4 at batch 4: fp32, autocast around
``infer``      each forward, ``param_dtype`` held around the loop, pure bf16, ``fp8`` held
               around the loop (each weight cast to float8 once) (size: d)
``convnet-``   a small conv net's train step: fp32, ``channels_last``, ``channels_last`` with
``train``      autocast around each step (size: height = width)
``transfor``   a small transformer's train step, bound by kernel launches on a fast GPU: fp32
``mer-train``  eager, bf16 autocast, ``@speedup`` compiled, ``@speedup(cuda_graphs=True)``
               (CUDA only: a CPU row says why) (size: sequence length)
=============  ===========================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._hardware import capabilities
from .configs import Config
from .model_problems import ConvNetProblem, LinearInferProblem, TransformerTrainProblem

# Re-exported (``X as X``): bench's runner, speedflags.bench and the tests import them here.
from .problems import ConvProblem as ConvProblem
from .problems import MatmulProblem as MatmulProblem
from .problems import MlpTrainProblem as MlpTrainProblem
from .problems import Problem as Problem
from .problems import Runner as Runner
from .problems import SdpaProblem as SdpaProblem

__all__ = ["WORKLOADS", "Problem", "Runner", "Workload", "memory_bytes"]


@dataclass(frozen=True)
class Workload:
    """A kind of work, its default sizes per device type, and the configurations compared.

    Example:
        >>> from speedflags._measure.workloads import WORKLOADS
        >>> matmul = WORKLOADS["matmul"]
        >>> matmul.sizes["cpu"], [c.name for c in matmul.configs][:3]
        ((1024, 2048), ['fp32', 'tf32', 'precision-high'])
    """

    name: str
    title: str
    size_meaning: str
    sizes: Mapping[str, tuple[int, ...]]
    smoke_size: int
    configs: tuple[Config, ...]
    build: Callable[[int, torch.device], Problem]
    devices: tuple[str, ...] = ("cpu", "cuda")
    why_only: str = ""

    def config(self, name: str) -> Config:
        for config in self.configs:
            if config.name == name:
                return config
        raise KeyError(f"{self.name} has no configuration {name!r}")

    def memory(self, size: int, device_type: str) -> int:
        """Bytes the problem holds at once at ``size``, at least (0: not estimated).

        Example:
            >>> from speedflags._measure.workloads import WORKLOADS
            >>> WORKLOADS["matmul"].memory(1024, "cpu") // 2**20  # MiB
            44
        """
        estimate: Callable[[int, str], int] | None = getattr(self.build, "memory", None)
        return estimate(size, device_type) if estimate is not None else 0

    def idle(self, config: Config, size: int) -> str | None:
        """Why ``config`` changes nothing in this workload at ``size`` (the fp8 size rule
        takes none of its layers), or None.

        Example:
            >>> from speedflags._measure.workloads import WORKLOADS
            >>> infer = WORKLOADS["linear-infer"]
            >>> fp8 = infer.config("fp8")
            >>> infer.idle(fp8, 8192) is None, infer.idle(fp8, 256)[:21]
            (True, 'fp8 takes no layer of')
        """
        found: str | None = self.build.idle(config, size)  # type: ignore[attr-defined]
        return found

    def flops(self, size: int, device_type: str) -> float:
        """Floating-point operations of one timed call at ``size``, before anything is built.

        Example:
            >>> from speedflags._measure.workloads import WORKLOADS
            >>> WORKLOADS["matmul"].flops(1024, "cpu") == 2 * 1024**3
            True
        """
        count: Callable[[int, str], float] = getattr(self.build, "flops_at")  # noqa: B009
        return count(size, device_type)

    def too_big(self, size: int, device: torch.device) -> str | None:
        """Why ``size`` does not fit in ``device``'s memory (estimated), or None.

        Example:
            >>> import torch
            >>> from speedflags._measure.workloads import WORKLOADS
            >>> WORKLOADS["matmul"].too_big(64, torch.device("cpu")) is None
            True
        """
        have = memory_bytes(device)
        need = self.memory(size, device.type)
        if have is None or need <= have:  # the system does not say: the run finds out
            return None
        return (
            f"{self.name} at size {size} needs at least {_gib(need)} of memory (estimated); "
            f"{device} has {_gib(have)}"
        )

    def same_as_another(
        self, config: Config, device: torch.device, configs: Sequence[Config] | None = None
    ) -> str | None:
        """Why ``config`` is no claim of its own on ``device``, or None: another of
        ``configs`` (the workload's own by default) that ``device`` can run does the same work
        there (:meth:`Config.in_effect`) with fewer levers that have no effect, so that a
        difference between the two would only be noise, credited to a lever that does
        nothing (``tf32+amp-bf16`` beside ``amp-bf16`` on a CPU).

        Example:
            >>> import torch
            >>> from speedflags._measure.workloads import WORKLOADS
            >>> mlp = WORKLOADS["mlp-train"]
            >>> print(mlp.same_as_another(mlp.config("tf32+amp-bf16"), torch.device("cpu")))
            the same as amp-bf16 on cpu: tf32: no effect on cpu: TF32 is a tensor-core ...
        """
        extra = config.notes(device)
        if not extra or config.baseline:
            return None
        does = config.in_effect(device)
        for other in self.configs if configs is None else configs:
            if other is config or len(other.notes(device)) >= len(extra):
                continue
            runs = other.unavailable(device) is None or other.emulated(device)
            if runs and other.in_effect(device) == does:
                return f"the same as {other.name} on {device}: {'; '.join(extra)}"
        return None

    def unavailable(self, device: torch.device) -> str | None:
        """Why this workload cannot run on ``device``, or None."""
        if device.type not in self.devices:
            return f"{self.name} runs on {', '.join(self.devices)} only: {self.why_only}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"{device}: {capabilities(device).bf16.reason}"
        return None


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def memory_bytes(device: torch.device) -> int | None:
    """The memory ``device`` has: the GPU's, or the machine's RAM; None where unknown.

    Total, not free: a size is refused only when it could never fit.

    Example:
        >>> import torch
        >>> from speedflags._measure.workloads import memory_bytes
        >>> memory_bytes(torch.device("cpu")) > 2**20
        True
    """
    if device.type == "cuda":
        properties: Any = torch.cuda.get_device_properties(device)  # untyped in 2.1's stubs
        return int(properties.total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX, or the system does not say
        return None


_BF16, _FP16 = torch.bfloat16, torch.float16
_FP32 = Config("fp32", {}, baseline=True)

MATMUL_CONFIGS = (
    _FP32,
    Config("tf32", {"tf32": True}),
    Config("precision-high", {"matmul_precision": "high"}),
    Config("precision-medium", {"matmul_precision": "medium"}),
    Config("amp-bf16", {"amp": "bf16"}),
    Config("amp-fp16", {"amp": "fp16"}),
    Config("pure-bf16", dtype=_BF16),
    Config("pure-fp16", dtype=_FP16),
)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "matmul",
            "float32 matmul",
            "n: (n x n) @ (n x n)",
            {"cpu": (1024, 2048), "cuda": (4096, 8192)},
            64,
            MATMUL_CONFIGS,
            MatmulProblem,
        ),
        Workload(
            "mlp-train",
            "3×Linear(d, d) AdamW train step",
            "d: Linear(d, d) x3, batch min(512, d)",
            {"cpu": (1024, 2048), "cuda": (4096, 8192)},
            64,
            (
                _FP32,
                # as a training loop enters them: around each step (@speedup's frame)
                Config("tf32+amp-bf16", {"tf32": True, "amp": "bf16"}, per_call=("tf32", "amp")),
                Config("amp-bf16", {"amp": "bf16"}, per_call=("amp",)),
                Config("param-bf16", {"param_dtype": "bf16"}, per_call=("param_dtype",)),
                Config(
                    "param-bf16+amp-bf16",
                    {"param_dtype": "bf16", "amp": "bf16"},
                    per_call=("param_dtype", "amp"),
                ),
                # torchao's float8 training on the large layers (the size rule), per step
                Config("fp8", {"fp8": True}, per_call=("fp8",)),
                Config("fp8+amp-bf16", {"fp8": True, "amp": "bf16"}, per_call=("fp8", "amp")),
            ),
            MlpTrainProblem,
        ),
        Workload(
            "sdpa",
            "scaled dot-product attention",
            "sequence length",
            {"cpu": (512, 1024), "cuda": (1024, 4096)},
            32,
            (
                Config("math", {"sdpa": "math"}, baseline=True),
                Config("flash", {"sdpa": "flash"}),
                Config("efficient", {"sdpa": "efficient"}),
                Config("cudnn", {"sdpa": "cudnn"}),
            ),
            SdpaProblem,
        ),
        Workload(
            "conv",
            "3x3 convolution",
            "height = width",
            {"cuda": (56, 112)},
            8,
            (
                _FP32,
                Config("cudnn-benchmark", {"cudnn_benchmark": True}),
                Config("tf32", {"tf32": True}),
                Config("tf32+cudnn-benchmark", {"tf32": True, "cudnn_benchmark": True}),
            ),
            ConvProblem,
            devices=("cuda",),
            why_only="cudnn_benchmark changes cuDNN's convolution algorithms, and a CPU has none",
        ),
        Workload(
            "linear-infer",
            "4xLinear(d, d) inference, batch 4",
            "d: Linear(d, d) x4, batch 4, no grad",
            {"cpu": (1024, 2048), "cuda": (2048, 8192)},
            64,
            (
                _FP32,
                # the usual way: torch.autocast around each forward, its weight casts redone
                Config("amp-bf16 each call", {"amp": "bf16"}, per_call=("amp",)),
                # held around the loop: each weight cast once
                Config("param-bf16", {"param_dtype": "bf16"}),
                Config("pure-bf16", dtype=_BF16),
                # held around the loop: each weight cast to float8 (with its scale) once
                Config("fp8", {"fp8": True}),
            ),
            LinearInferProblem,
        ),
        Workload(
            "convnet-train",
            "small conv net train step",
            "height = width: 3x conv3x3(64) + BatchNorm + ReLU, batch 32, SGD",
            {"cpu": (16, 32), "cuda": (56, 112)},
            8,
            (
                _FP32,
                Config("channels-last", {"memory_format": "channels_last"}),
                Config(
                    "channels-last+amp-bf16",
                    {"memory_format": "channels_last", "amp": "bf16"},
                    per_call=("amp",),
                ),
                Config("amp-bf16", {"amp": "bf16"}, per_call=("amp",)),
            ),
            ConvNetProblem,
        ),
        Workload(
            "transformer-train",
            "small transformer train step",
            "sequence length: TransformerEncoder(2 layers, d_model 256), batch 16, AdamW",
            {"cpu": (64,), "cuda": (64,)},
            8,
            (
                _FP32,
                Config("amp-bf16", {"amp": "bf16"}, per_call=("amp",)),
                Config("compiled+amp-bf16", {"amp": "bf16"}, step="compile"),
                Config("cuda-graphs+amp-bf16", {"amp": "bf16"}, step="cuda_graphs"),
            ),
            TransformerTrainProblem,
        ),
    )
}
