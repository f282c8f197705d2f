"""The problems the model levers are measured on: a model of the problem's own, built from a
private generator, that a configuration's ``param_dtype``, ``memory_format`` and ``fp8`` act
on.

=================  ==========================================================================
``linear-infer``   weight-bound inference: ``Linear(d, d)`` x4, batch 4, no grad. Each
                   forward reads every weight once; autocast around each forward also reads
                   and writes each weight to cast it, ``param_dtype`` casts once per block
``convnet-train``  a small conv net's train step (3x3 convolutions, BatchNorm, ReLU, a linear
                   head; SGD), the workload channels_last is for
``transformer-``   a small transformer's train step (2 encoder layers, d_model 256, batch 16;
``train``          AdamW), bound by kernel launches on a fast GPU: the workload CUDA graphs
                   are for
=================  ==========================================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.adamw import AdamW  # the defining module: 2.4's stubs do not re-export it

from .configs import Config
from .problems import Problem, Runner, _generator, _randn, fp8_idle

__all__ = ["ConvNetProblem", "LinearInferProblem", "TransformerTrainProblem"]


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
    def idle(config: Config, size: int) -> str | None:
        return fp8_idle(config, size)

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


class TransformerTrainProblem(Problem):
    """A small transformer's train step: ``nn.TransformerEncoder`` (2 layers, d_model 256, 4
    heads, feed-forward 1024, no dropout) and a linear head over 32 classes, batch 16 of
    ``size`` tokens; cross-entropy, backward, AdamW. Small enough that a fast GPU waits on
    kernel launches (``benchmarks/RESULTS.md``, "CUDA graphs"). The error is that of the
    first step's loss, from the same weights and batch, against a float64 copy.

    The optimizer's learning rate is a tensor on the device (what ``cuda_graphs=True`` asks
    of a step whose optimizer runs in the graph), the same for every configuration. FLOP: the
    encoder's matmuls, forward and backward (three times the forward), attention included.
    """

    workload = "transformer-train"
    error_of = "loss of the first step"
    d_model, heads, ff, layers, batch, classes = 256, 4, 1024, 2, 16, 32

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size, device)
        d, n, b = self.d_model, size, self.batch
        self.shape = (
            f"TransformerEncoder({self.layers} layers, d_model {d}, {self.heads} heads, "
            f"ff {self.ff}), batch {b} x {n} tokens, AdamW"
        )
        per_layer = 2.0 * b * n * (4 * d * d + 2 * d * self.ff) + 4.0 * b * n * n * d
        self.flops = 3.0 * (self.layers * per_layer + 2.0 * b * n * d * self.classes)
        self._gen = _generator(device)
        self._weights = self._make(torch.float32).state_dict()
        self._sets = self._rotated(
            lambda: (
                _randn((b, n, d), self._gen, device),
                torch.randint(0, self.classes, (b, n), generator=self._gen, device=device),
            )
        )

    def _make(self, dtype: torch.dtype) -> nn.Sequential:
        layer = nn.TransformerEncoderLayer(
            self.d_model, self.heads, self.ff, dropout=0.0, batch_first=True, device="meta"
        )
        encoder = nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=False)  # type: ignore[no-untyped-call, unused-ignore]
        model = nn.Sequential(encoder, nn.Linear(self.d_model, self.classes, device="meta"))
        model = model.to_empty(device=self.device)
        with torch.no_grad():
            if hasattr(self, "_weights"):
                model.load_state_dict(self._weights)
            else:
                for name, param in model.named_parameters():
                    if param.dim() > 1:
                        bound = param.shape[1] ** -0.5
                        param.uniform_(-bound, bound, generator=self._gen)
                    elif name.endswith("weight"):  # a LayerNorm's scale
                        param.fill_(1.0)
                    else:
                        param.uniform_(-0.01, 0.01, generator=self._gen)
        return model.to(dtype)

    def _loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).to(torch.float64 if x.dtype ==
                               torch.float64 else torch.float32), y.flatten())  # fmt: skip

    def runner(self, config: Config) -> Runner:
        from ..training import fast_optimizer  # local: the blocks' training helpers

        model = self._make(config.dtype or torch.float32)
        lr = torch.tensor(1e-3, device=self.device)  # read from device memory by a graph
        optimizer = fast_optimizer(AdamW, model.parameters(), lr=lr)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = self._loss(model, x, y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        timed = config.around(step, self.device, model)
        stats = getattr(timed, "stats", None)

        def first_loss() -> torch.Tensor:
            loss: torch.Tensor = timed(*self._sets[0])
            if stats is not None and stats.mode == "fallback":  # not what the row says
                raise RuntimeError(f"torch.compile fell back to eager: {stats.fallback_reason}")
            return loss

        return Runner(self._sets, timed, first_loss, model)

    @staticmethod
    def memory(size: int, device_type: str) -> int:
        # activations of the encoder (forward and backward), fp32 and the float64 reference
        p = TransformerTrainProblem
        per_token = p.layers * (8 * p.d_model + 2 * p.ff) + p.heads * size
        return p.batch * size * per_token * (4 + 8) * 3

    def _compute_reference(self) -> torch.Tensor:
        with torch.set_grad_enabled(True):
            model = self._make(torch.float64)
            x, y = self._sets[0]
            return self._loss(model, x.double(), y).detach()
