"""The problems the model levers are measured on: a model of the problem's own, built from a
private generator, that a configuration's ``param_dtype`` and ``memory_format`` act on.

=================  ==========================================================================
``linear-infer``   weight-bound inference: ``Linear(d, d)`` x4, batch 4, no grad. Each
                   forward reads every weight once; autocast around each forward also reads
                   and writes each weight to cast it, ``param_dtype`` casts once per block
``convnet-train``  a small conv net's train step (3x3 convolutions, BatchNorm, ReLU, a linear
                   head; SGD), the workload channels_last is for
=================  ==========================================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .configs import Config
from .problems import Problem, Runner, _generator, _randn

__all__ = ["ConvNetProblem", "LinearInferProblem"]


def _filled(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """``model`` (built on "meta") on its device with weights drawn from ``gen``: the
    process's global RNG is left as it was, and every configuration starts from the same
    weights."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "weight" and param.dim() > 1:
                bound = (param[0].numel()) ** -0.5
                param.uniform_(-bound, bound, generator=gen)
            elif name == "weight":  # a norm's scale
                param.fill_(1.0)
            else:
                param.uniform_(-0.01, 0.01, generator=gen)
    return model


class LinearInferProblem(Problem):
    """``Linear(d, d)`` x4 (with biases), batch 4, under ``torch.no_grad()``: weight-bound
    inference (each forward reads the weights, the activations are small).
    ``4 * 2 * batch * d^2`` FLOP."""

    workload = "linear-infer"
    layers = 4
    batch = 4

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        d = size
        self.shape = f"Linear({d}, {d}) x{self.layers}, batch {self.batch}, no grad"
        self.flops = self.flops_at(size, device.type)
        self._gen = _generator(device)
        self._weights = self._make(torch.float32).state_dict()
        self._sets = self._rotated(lambda: (_randn((self.batch, d), self._gen, device),))

    def _make(self, dtype: torch.dtype) -> nn.Sequential:
        d = self.size
        model = nn.Sequential(*(nn.Linear(d, d, device="meta") for _ in range(self.layers)))
        model = model.to_empty(device=self.device)
        with torch.no_grad():
            if hasattr(self, "_weights"):
                model.load_state_dict(self._weights)
            else:
                _filled(model, self._gen)
        return model.to(dtype).eval()

    def runner(self, config: Config) -> Runner:
        model = self._make(config.dtype or torch.float32)

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model(x)  # type: ignore[no-any-return]

        sets = (
            [tuple(t.to(config.dtype) for t in s) for s in self._sets]
            if config.dtype
            else (self._sets)
        )
        timed = config.around(forward, self.device, model)
        return Runner(sets, timed, lambda: timed(*sets[0]), model)

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        return float(LinearInferProblem.layers * 2 * LinearInferProblem.batch * size * size)

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        # the weights in fp32, a bf16 copy (param_dtype, pure bf16), the float64 reference's
        weights = LinearInferProblem.layers * size * size
        return (4 + 4 + 2 + 8) * weights

    def _compute_reference(self) -> torch.Tensor:
        with torch.no_grad():
            model = self._make(torch.float64)
            (x,) = self._sets[0]
            out: torch.Tensor = model(x.double())
        return out


class ConvNetProblem(Problem):
    """A small conv net's train step: three 3x3 convolutions (64 channels) with BatchNorm and
    ReLU, global average pooling, a linear head; cross-entropy, backward, SGD. Input
    (batch 32, 3, size, size). FLOP: the convolutions' forward and backward (three times
    their forward's), the head ignored."""

    workload = "convnet-train"
    error_of = "first convolution's weight gradient"
    channels = 64
    batch = 32
    classes = 10

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        c, b = self.channels, self.batch
        self.shape = f"3x conv3x3({c}) + BatchNorm + ReLU, input ({b}, 3, {size}, {size}), SGD"
        self.flops = self.flops_at(size, device.type)
        self._gen = _generator(device)
        self._weights = self._make(torch.float32).state_dict()
        self._sets = self._rotated(
            lambda: (
                _randn((b, 3, size, size), self._gen, device),
                torch.randint(0, self.classes, (b,), generator=self._gen, device=device),
            )
        )

    def _make(self, dtype: torch.dtype) -> nn.Sequential:
        c = self.channels
        layers: list[nn.Module] = []
        for cin in (3, c, c):
            conv = nn.Conv2d(cin, c, 3, padding=1, device="meta")
            layers += [conv, nn.BatchNorm2d(c, device="meta"), nn.ReLU()]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, self.classes, device="meta")]
        model = nn.Sequential(*layers).to_empty(device=self.device)
        with torch.no_grad():
            if hasattr(self, "_weights"):
                model.load_state_dict(self._weights)
            else:
                _filled(model, self._gen)
                for module in model.modules():
                    if isinstance(module, nn.BatchNorm2d):
                        module.reset_running_stats()
        return model.to(dtype)

    def runner(self, config: Config) -> Runner:
        dtype = config.dtype or torch.float32
        model = self._make(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            return loss.detach()

        sets = [(x.to(dtype), y) for x, y in self._sets]

        def gradient() -> torch.Tensor:  # of a fresh copy, inside the same levers
            fresh = self._make(dtype)
            framed = config.around(lambda: self._gradient(fresh, *sets[0]), self.device, fresh)
            if config.model_levers:
                with config.frames(self.device, fresh):
                    return framed()  # type: ignore[no-any-return]
            return framed()  # type: ignore[no-any-return]

        return Runner(sets, config.around(step, self.device, model), gradient, model)

    @staticmethod
    def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        F.cross_entropy(model(x).to(torch.float64 if x.dtype == torch.float64 else torch.float32),
                        y).backward()  # type: ignore[no-untyped-call]  # fmt: skip
        first: Any = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        grad: torch.Tensor = first.weight.grad
        return grad

    @staticmethod
    def flops_at(size: int, device_type: str) -> float:
        c, b = ConvNetProblem.channels, ConvNetProblem.batch
        forward = 2.0 * b * size * size * 9 * (3 * c + c * c + c * c)
        return 3.0 * forward

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        # activations of three conv blocks (forward and backward), in fp32 and float64
        b, c = ConvNetProblem.batch, ConvNetProblem.channels
        return 3 * 3 * b * c * size * size * (4 + 8)

    def _compute_reference(self) -> torch.Tensor:
        with torch.set_grad_enabled(True):
            model = self._make(torch.float64)
            x, y = self._sets[0]
            return self._gradient(model, x.double(), y)
