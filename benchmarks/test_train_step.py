"""A small transformer's train step: fp32 eager, against @speedup with bf16 autocast, with
bf16 autocast plus torch.compile (inductor), and the same compiled through CUDA Graphs, by
compile mode ("reduce-overhead") and by ``@speedup(cuda_graphs=True)``.

Each variant trains its own copy of one initialisation on the same batches. Before timing,
five steps of each are compared with fp32 eager on the same batches: the largest relative
difference of the losses goes in ``extra_info["loss_rel_err_vs_fp32"]``. Inputs are fresh
random batches from a fixed generator (a pool cycled through), never zeros. On CUDA the
step ends with a synchronize, so the timer sees the kernels.

The CUDA Graphs variant (``compile={"mode": "reduce-overhead"}``: inductor records each
compiled graph once and replays it, one launch for its kernels) is for steps bound by kernel
launches, as this one is on a fast GPU. It is CUDA-only. A replayed graph reads its inputs
from fixed addresses: inductor copies each new batch in before a replay (the parameters and
the optimizer's state stay where they are), and its outputs (the loss returned here, the
gradients) live in the graph's memory, overwritten by the next replay: each is used before
the next step (the loss is read at once, the optimizer consumes the gradients within the
step). ``torch.compiler.cudagraph_mark_step_begin()`` before each call tells PyTorch a new
step begins, as its documentation asks for training loops.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import speedflags

D_MODEL, HEADS, FF, LAYERS, BATCH, SEQ, CLASSES = 256, 4, 1024, 2, 16, 64, 32
CHECK_STEPS = 5

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, device=device
    )
    encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    return torch.nn.Sequential(encoder, torch.nn.Linear(D_MODEL, CLASSES, device=device))


def _batches(device: str, count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(BATCH, SEQ, D_MODEL, generator=gen).to(device),
            torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen).to(device),
        )
        for _ in range(count)
    ]


def _make_step(device: str, variant: str) -> Callable[..., torch.Tensor]:
    return _make(device, variant)[0]


def parts(
    device: str, lr: float | torch.Tensor = 1e-3
) -> tuple[Callable[..., torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    """The plain train step (forward, cross-entropy, backward, a fused AdamW step), its model
    and its optimizer, from one initialisation."""
    model = _model(device)
    opt = speedflags.training.fast_optimizer(torch.optim.AdamW, model.parameters(), lr=lr)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step, model, opt


def _make(device: str, variant: str) -> tuple[Callable[..., torch.Tensor], torch.nn.Module]:
    """The variant's train step and the model it trains (for checking its parameters)."""
    # cuda_graphs=True asks for a learning rate a graph reads from device memory (the same
    # value: the same arithmetic as the float the other variants use)
    lr: float | torch.Tensor = 1e-3
    if variant == "speedup-bf16-cuda-graphs":
        lr = torch.tensor(1e-3, device=device)
    train_step, model, _ = parts(device, lr)

    amp = "bf16"
    if variant == "fp32-eager":
        return train_step, model
    if variant == "speedup-bf16":
        return speedflags.speedup(amp=amp, device=device)(train_step), model
    if variant == "speedup-bf16-compile":
        return speedflags.speedup(amp=amp, device=device, compile=True)(train_step), model
    if variant == "speedup-bf16-graphs":
        graphed = speedflags.speedup(amp=amp, device=device, compile={"mode": "reduce-overhead"})
        return _marking_steps(graphed(train_step)), model
    if variant == "speedup-bf16-cuda-graphs":  # the same, asked for by its own option
        return speedflags.speedup(amp=amp, device=device, cuda_graphs=True)(train_step), model
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def _marking_steps(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step``, telling CUDA Graph Trees a new step begins before each call (where this
    PyTorch has ``torch.compiler.cudagraph_mark_step_begin``)."""
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    @functools.wraps(step)  # keeps step.stats
    def marked(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if mark is not None:
            mark()
        return step(x, y)

    return marked


VARIANTS = [
    "fp32-eager",
    "speedup-bf16",
    "speedup-bf16-compile",
    "speedup-bf16-graphs",
    "speedup-bf16-cuda-graphs",
]
# variants that need a CUDA device, and why
CUDA_ONLY = {
    "speedup-bf16-graphs": "CUDA Graphs (compile mode 'reduce-overhead') need a CUDA device",
    "speedup-bf16-cuda-graphs": "no CUDA: @speedup(cuda_graphs=True) has no effect on a CPU",
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_train_step(benchmark: Any, device: str, variant: str) -> None:
    if device != "cuda" and variant in CUDA_ONLY:
        pytest.skip(CUDA_ONLY[variant])
    benchmark.group = f"train-step-{device}"
    batches = _batches(device)
    reference = _make_step(device, "fp32-eager")
    step = _make_step(device, variant)
    ref_losses = [float(reference(x, y)) for x, y in batches[:CHECK_STEPS]]
    losses = [float(step(x, y)) for x, y in batches[:CHECK_STEPS]]  # compiles here
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    benchmark.extra_info["loss_rel_err_vs_fp32"] = rel
    benchmark.extra_info["losses"] = losses
    benchmark.extra_info["shape"] = (
        f"d_model={D_MODEL} heads={HEADS} ff={FF} layers={LAYERS} batch={BATCH} seq={SEQ}"
    )
    stats = getattr(step, "stats", None)
    if stats is not None:
        benchmark.extra_info["mode"] = stats.mode
        assert stats.mode != "fallback", stats.fallback_reason
    assert rel < 3e-2, (losses, ref_losses)  # bf16 keeps 8 mantissa bits

    pool = itertools.cycle(batches)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def one_step() -> None:
        x, y = next(pool)
        step(x, y)
        sync()

    benchmark.pedantic(one_step, rounds=20, warmup_rounds=3)
