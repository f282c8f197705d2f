"""``speedflags.tune`` on the bench suites' workloads and on a Hugging Face GPT-2 train step.

Run from the repository root::

    HF_HUB_OFFLINE=1 python benchmarks/tune_runs.py [--only mlp,gpt2] [--seconds 120]

Each run prints its table, saves its result to ``benchmarks/results/tune-<name>.json``
and ends with one summary line per run (what ``RESULTS.md`` quotes). The workloads
mirror ``speedflags/bench/workloads.py`` (matmul, mlp-train, sdpa) at their CPU sizes,
plus the MLP forward of issue 12; the GPT-2 is a small one built from ``GPT2Config``
(nothing is downloaded). Train steps return the loss and one weight gradient, so the
error covers the backward pass too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import speedflags

Step = tuple[Callable[..., Any], tuple[Any, ...]]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def matmul(n: int) -> Step:
    gen = torch.Generator().manual_seed(0)
    return torch.mm, (torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen))


def mlp_forward() -> Step:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    return model, (torch.randn(256, 1024),)


def mlp_train(d: int = 1024) -> Step:
    """The bench's mlp-train workload: Linear(d, d) x3 with GELU, AdamW, batch min(512, d)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = min(512, d)
    x, y = torch.randn(batch, d), torch.randn(batch, d)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        return loss.detach(), model[0].weight.grad

    return step, (model, opt, x, y)


def sdpa(length: int = 512) -> Step:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, length, 64, generator=gen) for _ in range(3))
    return F.scaled_dot_product_attention, (q, k, v)


def gpt2() -> Step:
    """A tiny GPT-2 (2 layers, 128 wide, 4k vocabulary) train step, batch 8 x 64 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=128, n_positions=128, vocab_size=4096,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))

    def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach(), model.transformer.h[0].attn.c_attn.weight.grad

    return step, (model, opt, ids)


RUNS: dict[str, tuple[Callable[[], Step], float]] = {
    "matmul-1024": (lambda: matmul(1024), 5e-2),
    "matmul-2048": (lambda: matmul(2048), 5e-2),
    "mlp-forward": (mlp_forward, 5e-2),
    "mlp-forward-1e-6": (mlp_forward, 1e-6),
    "mlp-forward-1e-9": (mlp_forward, 1e-9),
    "mlp-train-1024": (mlp_train, 5e-2),
    "sdpa-512": (sdpa, 5e-2),
    "gpt2-train": (gpt2, 5e-2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated run names")
    parser.add_argument("--seconds", type=float, default=120.0, help="bound per run (120)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    levers = list(speedflags.levers.registry.LEVER_NAMES) if args.no_compile else None
    os.makedirs(RESULTS, exist_ok=True)
    lines = []
    for name in args.only.split(","):
        build, budget = RUNS[name]
        fn, fn_args = build()
        print(f"== {name} (budget {budget:g}, load {os.getloadavg()[0]:.2f})", file=sys.stderr)
        began = time.perf_counter()
        result = speedflags.tune(fn, *fn_args, budget=budget, seconds=args.seconds, levers=levers)
        print(result, flush=True)
        suffix = f"-{torch.get_num_threads()}t"
        result.save(os.path.join(RESULTS, f"tune-{name}{suffix}.json"))
        chosen = result.chosen
        lines.append(
            f"{name}: {time.perf_counter() - began:.0f} s, best {result.best or 'fp32'}, "
            f"{chosen.speedup if chosen else 1.0:.2f}x, error {chosen.error if chosen else 0:.1e}, "
            f"compile {result.compile}, load {os.getloadavg()[0]:.2f}"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
