"""The problems: what is timed, its FLOP count, its inputs, and its float64 reference.

A :class:`Problem` is one workload at one size on one device: input sets drawn from a fixed
generator (random normals, never zeros), rotated past the cache; the float64 reference;
and, per configuration, a :class:`Runner` whose ``run`` is the timed call. Which problems
are measured, at which sizes and with which configurations, is
:data:`speedflags._measure.workloads.WORKLOADS`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.amp.autocast_mode import autocast  # 2.1's stubs: not from torch or torch.amp
from torch.optim.adamw import AdamW  # the defining module: 2.4's stubs do not re-export it

from .._hardware import capabilities
from .accuracy import relative_error
from .configs import Config
from .timing import cache_bytes, rotation_sets

__all__ = ["ConvProblem", "MatmulProblem", "MlpTrainProblem", "Problem", "Runner", "SdpaProblem"]

SEED = 20261122
Inputs = tuple[torch.Tensor, ...]


def _generator(device: torch.device) -> torch.Generator:
    # A private generator: the process's global RNG is left exactly as it was.
    return torch.Generator(device=device).manual_seed(SEED)


def _randn(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Runner:
    """One configuration of one problem: ``setup()`` outside the timer, ``run()`` inside.

    ``setup`` returns the next input set (rotating); ``run(*inputs)`` is the timed work;
    ``output()`` is what is compared with the float64 reference (call it, like ``run``,
    inside the configuration's frames); ``model`` is the module the configuration's model
    levers act on (None: the problem has none).
    """

    def __init__(
        self,
        sets: Sequence[Inputs],
        call: Callable[..., Any],
        output: Callable[[], torch.Tensor] | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self._sets = list(sets)
        self._call = call
        self._next = 0
        self._output = output
        self.model = model

    def setup(self) -> Inputs:
        inputs = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        return inputs

    def run(self, *inputs: torch.Tensor) -> Any:
        return self._call(*inputs)

    def output(self) -> torch.Tensor:
        if self._output is not None:
            return self._output()
        result: torch.Tensor = self._call(*self._sets[0])
        return result


class Problem:
    """One workload at one size on one device.

    Attributes:
        workload, size, device: what this is.
        shape: the work in words (``"(2048x2048) @ (2048x2048)"``).
        flops: floating-point operations per timed call.
        input_precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` where the inputs themselves are.
        error_of: what ``error`` compares (``"output"``, ``"first-layer weight gradient"``).
        sets: input sets rotated through (see :func:`~speedflags._measure.timing.rotation_sets`).
    """

    workload = ""
    shape = ""
    flops = 0.0
    input_precision = "fp32"
    error_of = "output"

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self.sets = 1
        self._reference: torch.Tensor | None = None

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        """Bytes the problem holds at once at ``size``, at least: its inputs, its outputs,
        its float64 reference (``bench --sizes`` refuses a size the device cannot hold)."""
        raise NotImplementedError

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        """:attr:`flops` at ``size`` on ``device_type``, before anything is built (``bench``
        says from it how long a run will take)."""
        raise NotImplementedError

    def runner(self, config: Config) -> Runner:
        raise NotImplementedError

    def skip_reason(self, config: Config) -> str | None:
        """Why ``config`` cannot be measured here, or None."""
        return config.unavailable(self.device)

    @staticmethod
    def idle(config: Config, size: int) -> str | None:
        """Why ``config`` would change nothing in this problem at ``size`` whatever the
        device (its model has no layer the lever takes), or None. Such a row is skipped, not
        measured as the baseline under another name (nor as an emulated one)."""
        return None

    def reference(self) -> torch.Tensor:
        """The float64 result on the first input set (computed once, autocast off)."""
        if self._reference is None:
            with autocast(self.device.type, enabled=False):
                self._reference = self._compute_reference()
        return self._reference

    def _compute_reference(self) -> torch.Tensor:
        raise NotImplementedError

    def error(self, runner: Runner) -> float:
        """Relative error of ``runner`` against the float64 reference, on the first input set."""
        with torch.no_grad():
            reference = self.reference()
        return relative_error(runner.output(), reference)

    def _rotated(self, make: Callable[[], Inputs]) -> list[Inputs]:
        first = make()
        self.sets = rotation_sets(_nbytes(first), cache_bytes(self.device))
        return [first] + [make() for _ in range(self.sets - 1)]


def fp8_idle(config: Config, size: int) -> str | None:
    """Why ``config``'s ``fp8`` converts none of a problem's ``Linear(size, size)`` layers
    (torchao's dimension rule, the size rule), or None (it converts them, or sets no fp8).

    Example:
        >>> from speedflags._measure.configs import Config
        >>> from speedflags._measure.problems import fp8_idle
        >>> fp8 = Config("fp8", {"fp8": True})
        >>> fp8_idle(fp8, 4096) is None, fp8_idle(fp8, 1024)[:44]
        (True, 'fp8 takes no layer of Linear(1024, 1024): be')
    """
    if config.levers.get("fp8") in (None, False):
        return None
    from ..levers._fp8_swap import size_rule  # the fp8 lever's own rule, loaded with it

    why = size_rule(size, size)
    return None if why is None else f"fp8 takes no layer of Linear({size}, {size}): {why}"


def _cast(sets: Sequence[Inputs], dtype: torch.dtype | None) -> list[Inputs]:
    if dtype is None:
        return list(sets)
    return [tuple(t.to(dtype) for t in inputs) for inputs in sets]


class MatmulProblem(Problem):
    """``a @ b`` on n x n float32 inputs; ``2 n^3`` FLOP."""

    workload = "matmul"

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        n = size
        self.shape = f"({n}x{n}) @ ({n}x{n})"
        self.flops = self.flops_at(size, device.type)
        gen = _generator(device)
        self._sets = self._rotated(
            lambda: (_randn((n, n), gen, device), _randn((n, n), gen, device))
        )

    def runner(self, config: Config) -> Runner:
        return Runner(_cast(self._sets, config.dtype), torch.mm)

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        return 2.0 * size**3

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        # a, b and a @ b in fp32; their float64 copies for the reference; the pure bf16 and
        # fp16 configurations' copies of a and b
        return (3 * 4 + 3 * 8 + 2 * 2 * 2) * size * size

    def _compute_reference(self) -> torch.Tensor:
        a, b = self._sets[0]
        out: torch.Tensor = a.double() @ b.double()  # typed: @ is Any in 2.1's stubs
        return out


class MlpTrainProblem(Problem):
    """The 3×Linear(d, d) AdamW train step: ``Linear(d, d)`` x3, GELU, forward, backward.

    FLOP: the eight GEMMs of a step (three forward, three weight gradients, two input
    gradients: the input itself needs none), ``8 * 2 * batch * d^2``; the optimizer, GELU
    and loss are not counted. The error is that of the first layer's weight gradient, from
    the same starting weights and batch, against a float64 copy of the model.
    """

    workload = "mlp-train"
    error_of = "first-layer weight gradient"
    layers = 3

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        d = size
        self.batch = min(512, d)
        self.shape = f"Linear({d}, {d}) x{self.layers} + GELU, batch {self.batch}, AdamW"
        self.flops = self.flops_at(size, device.type)
        gen = _generator(device)
        bound = d**-0.5  # nn.Linear's default init range, drawn from the private generator
        self._init = [
            torch.empty(shape, device=device).uniform_(-bound, bound, generator=gen)
            for _ in range(self.layers)
            for shape in ((d, d), (d,))
        ]
        self._sets = self._rotated(
            lambda: (_randn((self.batch, d), gen, device), _randn((self.batch, d), gen, device))
        )

    def _model(self, dtype: torch.dtype) -> nn.Sequential:
        d = self.size
        blocks: list[nn.Module] = []
        for i in range(self.layers):
            # Built on "meta" so that nn.Linear's own init does not draw from the global RNG.
            blocks.append(nn.Linear(d, d, device="meta"))
            if i < self.layers - 1:
                blocks.append(nn.GELU())
        model = nn.Sequential(*blocks).to_empty(device=self.device).to(dtype)
        with torch.no_grad():
            for param, init in zip(model.parameters(), self._init, strict=True):
                param.copy_(init)
        return model

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        layers, batch = MlpTrainProblem.layers, min(512, size)
        return float((3 * layers - 1) * 2 * batch * size * size)

    @staticmethod
    def _first_weight(model: nn.Sequential) -> torch.Tensor:
        first = model[0]
        assert isinstance(first, nn.Linear)  # noqa: S101 - built by _model
        return first.weight

    def runner(self, config: Config) -> Runner:
        dtype = config.dtype or torch.float32
        model = self._model(dtype)
        optimizer = AdamW(model.parameters(), lr=1e-4)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y.float())
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            return loss.detach()

        def gradient() -> torch.Tensor:  # of a fresh copy, inside the same levers
            fresh = self._model(dtype)
            framed = config.around(lambda: self._gradient(dtype, fresh), self.device, fresh)
            if config.model_levers and fresh is not None:
                with config.frames(self.device, fresh):
                    return framed()  # type: ignore[no-any-return]
            return framed()  # type: ignore[no-any-return]

        timed = config.around(step, self.device, model)
        return Runner(_cast(self._sets, config.dtype), timed, gradient, model)

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        # per weight element: the initial copy (4 bytes); two fp32 configurations, each a
        # model, its gradients and AdamW's two moments (2 x 16); the float64 reference's
        # model and gradients (16); the inputs, batch x d, are small beside them
        weights = MlpTrainProblem.layers * size * size
        return (4 + 2 * 16 + 16) * weights + 2 * 4 * min(512, size) * size

    @staticmethod
    def idle(config: Config, size: int) -> str | None:
        return fp8_idle(config, size)

    def _gradient(self, dtype: torch.dtype, model: nn.Sequential | None = None) -> torch.Tensor:
        model = self._model(dtype) if model is None else model
        x, y = (t.to(dtype) for t in self._sets[0])
        # the loss in float32 (float64 for the reference), as the timed step computes it:
        # PyTorch 2.1 has no bfloat16 mse_loss on a CPU
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        F.mse_loss(model(x).to(wide), y.to(wide)).backward()  # type: ignore[no-untyped-call]
        grad: torch.Tensor | None = self._first_weight(model).grad  # Any in 2.1's stubs
        assert grad is not None  # noqa: S101 - backward always fills it
        return grad

    def _compute_reference(self) -> torch.Tensor:
        with torch.set_grad_enabled(True):  # typed on every PyTorch, unlike enable_grad
            return self._gradient(torch.float64)


_SDPA_KERNELS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


class SdpaProblem(Problem):
    """``scaled_dot_product_attention(q, k, v)``, no mask; ``4 B H L^2 D`` FLOP.

    CPU: batch 2, 8 heads, head dim 64, float32. CUDA: batch 4, 16 heads, head dim 128, in
    bf16 (fp16 on GPUs without native bf16), the dtypes the fused kernels take.
    """

    workload = "sdpa"
    shapes = ((2, 8, 64), (4, 16, 128))  # batch, heads, head dim: on a CPU, on CUDA

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        batch, heads, dim = self.shapes[device.type == "cuda"]
        if device.type == "cuda":
            dtype = torch.bfloat16 if capabilities(device).bf16 else torch.float16
        else:
            dtype = torch.float32
        self.input_precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        shape = (batch, heads, size, dim)
        self.shape = f"q, k, v ({batch}, {heads}, {size}, {dim}) {str(dtype).replace('torch.', '')}"
        self.flops = self.flops_at(size, device.type)
        gen = _generator(device)
        self._sets = self._rotated(
            lambda: tuple(_randn(shape, gen, device).to(dtype) for _ in range(3))
        )

    def runner(self, config: Config) -> Runner:
        return Runner(_cast(self._sets, config.dtype), F.scaled_dot_product_attention)

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        batch, heads, dim = SdpaProblem.shapes[device_type == "cuda"]
        return 4.0 * batch * heads * size * size * dim

    def skip_reason(self, config: Config) -> str | None:
        reason = super().skip_reason(config)
        backends = config.levers.get("sdpa")
        if reason is not None or not backends:
            return reason
        # speedflags keeps the math kernel enabled as a fallback, so a preferred kernel that
        # refuses these inputs would silently time math instead: ask the kernel alone first.
        name = backends if isinstance(backends, str) else backends[0]
        return _kernel_refuses(name, self._sets[0])

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        batch, heads, dim = SdpaProblem.shapes[device_type == "cuda"]
        item = 2 if device_type == "cuda" else 4
        # the reference's scores and their softmax in float64; the math kernel's, in the
        # inputs' dtype; q, k, v and their float64 copies
        scores = batch * heads * size * size * (2 * 8 + 2 * item)
        return scores + 3 * batch * heads * size * dim * (item + 8)

    def _compute_reference(self) -> torch.Tensor:
        q, k, v = (t.double() for t in self._sets[0])
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        out: torch.Tensor = scores.softmax(dim=-1) @ v
        return out


def _kernel_refuses(name: str, inputs: Inputs) -> str | None:
    alone = _kernel_alone(name)
    if alone is None:
        return f"PyTorch {torch.__version__} has no {name!r} SDPA kernel"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns why each kernel refuses; we say it below
        try:
            q, k, v = inputs
            with alone, torch.no_grad():
                F.scaled_dot_product_attention(q, k, v)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"the {name!r} SDPA kernel refuses these inputs: {first}"
    return None


def _kernel_alone(name: str) -> AbstractContextManager[Any] | None:
    """A context that enables the ``name`` SDPA kernel alone, or None if torch has none."""
    try:
        attention: Any = importlib.import_module("torch.nn.attention")  # not in 2.1's stubs
    except ImportError:  # PyTorch 2.1: torch.backends.cuda.sdp_kernel, one flag per kernel
        flag = _SDP_KERNEL_FLAGS.get(name)
        sdp_kernel = getattr(torch.backends.cuda, "sdp_kernel", None)
        if flag is None or sdp_kernel is None:
            return None
        flags = dict.fromkeys(_SDP_KERNEL_FLAGS.values(), False)
        return sdp_kernel(**{**flags, flag: True})  # type: ignore[no-any-return]
    backend = getattr(attention.SDPBackend, _SDPA_KERNELS[name], None)
    return None if backend is None else attention.sdpa_kernel([backend])


_SDP_KERNEL_FLAGS = {
    "flash": "enable_flash",
    "efficient": "enable_mem_efficient",
    "math": "enable_math",
}


class ConvProblem(Problem):
    """A 3x3 ``conv2d`` (stride 1, padding 1), float32 NCHW; ``2 N C_out H W C_in 9`` FLOP.

    CUDA: batch 32, 128 channels; CPU (only when asked for directly): batch 8, 64 channels.
    """

    workload = "conv"
    shapes = ((8, 64), (32, 128))  # batch, channels: on a CPU, on CUDA

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        batch, channels = self.shapes[device.type == "cuda"]
        self.shape = f"conv2d 3x3, input ({batch}, {channels}, {size}, {size})"
        self.flops = self.flops_at(size, device.type)
        gen = _generator(device)
        self._weight = _randn((channels, channels, 3, 3), gen, device) * (channels * 9) ** -0.5
        self._sets = self._rotated(lambda: (_randn((batch, channels, size, size), gen, device),))

    def runner(self, config: Config) -> Runner:
        weight = self._weight if config.dtype is None else self._weight.to(config.dtype)

        def conv(x: torch.Tensor) -> torch.Tensor:
            return F.conv2d(x, weight, padding=1)

        return Runner(_cast(self._sets, config.dtype), conv)

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        batch, channels = ConvProblem.shapes[device_type == "cuda"]
        return 2.0 * batch * channels * size * size * channels * 9

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        batch, channels = ConvProblem.shapes[device_type == "cuda"]
        # input and output in fp32, and both again in float64 for the reference
        return batch * channels * size * size * 2 * (4 + 8)

    def _compute_reference(self) -> torch.Tensor:
        (x,) = self._sets[0]
        return F.conv2d(x.double(), self._weight.double(), padding=1)
