"""Train a toy transformer language model, in fp32 and then with speedflags' levers.

The same training steps (embedding, causal transformer encoder, LM head, AdamW) run in plain
fp32 (TF32 off, matmul precision "highest", no autocast) and with the levers recommended for
the device (TF32 and bf16 autocast on an Ampere or newer GPU) or those given with
``--levers``, in interleaved passes (fp32, levers, fp32, ...), each with a warm-up step of its
own. It prints the time per step of each and the speedup with its noise (or, where the levers
change nothing on the device, says so instead), and checks that every flag ends as it began.

    python examples/train_toy_transformer.py                  # for real (CUDA if available)
    python examples/train_toy_transformer.py --levers tf32=true,amp=bf16
    python examples/train_toy_transformer.py --config examples/configs/speed.yaml
    python examples/train_toy_transformer.py --smoke          # tiny sizes on a CPU (CI)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import _common as common
import torch
from torch import nn

import speedflags


class ToyLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(x, mask=self.mask, is_causal=True))


def make_step(
    model: ToyLM, amp: Any, device: torch.device, batch: int, seq: int, vocab: int
) -> Callable[[], float]:
    optimizer = speedflags.training.fast_optimizer(torch.optim.AdamW, model.parameters(), lr=3e-4)
    scaler = speedflags.training.grad_scaler(amp if amp is not None else False, device=device)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)

    def step() -> float:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return float(loss.detach())

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    device = common.pick_device(args.device, args.smoke)
    size: dict[str, int] = (
        dict(vocab=64, width=32, depth=1, heads=2, seq=16, batch=4, steps=3)
        if args.smoke
        else dict(vocab=8192, width=512, depth=6, heads=8, seq=256, batch=32, steps=30)
    )
    count = common.passes(args.passes, args.smoke)
    steps = args.steps or size["steps"]
    levers = common.chosen_levers(args.levers, device, args.config)
    print(f"device: {speedflags.capabilities(device).device}; torch {torch.__version__}")
    print(
        f"{count} interleaved passes of {steps} steps, fp32 then the levers: each pass says how "
        "long it will take after its first timed step (full size: about 25 min on a 2-core CPU, "
        "a minute on a GPU)",
        flush=True,
    )

    with common.flags_as_found():
        runs = {}
        left = [2 * count]  # passes left to run, of both configurations
        for name, setting in (("fp32", common.FP32), ("speedflags", levers)):
            torch.manual_seed(0)
            model = ToyLM(size["vocab"], size["width"], size["depth"], size["heads"], size["seq"])
            model = model.to(device)
            step = make_step(
                model, setting.get("amp"), device, size["batch"], size["seq"], size["vocab"]
            )
            # fast_math() with no levers means "the recommended ones": pass the empty case as FP32
            spec = speedflags.fast_math(device=device, **(setting or common.FP32))
            runs[name] = common.timed_pass(spec, step, steps, device, left)
        times = common.interleaved(runs, count)
        print(common.speedup_line("toy transformer LM", times, levers, device, args.smoke))


if __name__ == "__main__":
    main()
