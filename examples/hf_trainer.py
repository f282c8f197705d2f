"""Train a tiny GPT-2 with the Hugging Face Trainer, in fp32 and then with speedflags' callback.

The model is built from a ``GPT2Config`` (no download: ``HF_HUB_OFFLINE=1``) and trained on
synthetic tokens. The same training runs from the same weights with plain fp32 levers and
with ``SpeedFlagsCallback(train=levers, evaluate={"amp": False})``, where the levers are those
recommended for the device (TF32 and bf16 autocast on an Ampere or newer GPU) or given with
``--levers``, in interleaved passes (a training run each: fp32, levers, fp32, ...), whose
first step is each pass's warm-up. It prints the time per training step of each and the
speedup with its noise (or, where the levers change nothing on the device, says so instead),
evaluates in full precision, and checks that every flag ends as it began.

    python examples/hf_trainer.py                    # for real (CUDA if available)
    python examples/hf_trainer.py --smoke            # tiny sizes on a CPU (CI)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import _common as common
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import speedflags
from speedflags.integrations.transformers import SpeedFlagsCallback


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (nothing to download)."""

    def __init__(self, count: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (count, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    """Time per optimizer step, the first one excluded, with progress lines. Added after
    SpeedFlagsCallback, so it starts after the levers are applied and stops after they are
    restored."""

    def __init__(self, device: torch.device, progress: common.Progress) -> None:
        self.device = device
        self.progress = progress
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        common.sync(self.device)
        self.start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        common.sync(self.device)
        self.times.append(time.perf_counter() - self.start)
        if len(self.times) == 1:
            self.progress.first(self.times[0], state.max_steps - 1)
        else:
            self.progress.step(len(self.times) - 1, state.max_steps - 1)

    @property
    def seconds(self) -> float:
        timed = self.times[1:] or self.times
        return sum(timed) / len(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_arguments(parser)
    args = parser.parse_args()
    device = common.pick_device(args.device, args.smoke)
    size: dict[str, int] = (
        dict(layers=1, width=32, heads=2, seq=32, vocab=128, batch=4, steps=4)
        if args.smoke
        else dict(layers=6, width=512, heads=8, seq=256, vocab=8192, batch=16, steps=40)
    )
    levers = common.chosen_levers(args.levers, device, args.config)
    config = GPT2Config(
        n_layer=size["layers"], n_embd=size["width"], n_head=size["heads"],
        n_positions=size["seq"], vocab_size=size["vocab"], bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    data = Tokens(size["batch"] * size["steps"], size["seq"], size["vocab"])
    count = common.passes(args.passes, args.smoke)
    print(f"device: {speedflags.capabilities(device).device}; GPT-2 {size}")
    print(
        f"{count} interleaved passes of {size['steps']} Trainer steps, fp32 then the levers: "
        "each pass says how long it will take after its first timed step",
        flush=True,
    )

    with common.flags_as_found(), tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        start = GPT2LMHeadModel(config).state_dict()
        left = [2 * count]
        evaluated: list[float] = []

        def run(name: str, train: dict[str, Any], label: str) -> float:
            model = GPT2LMHeadModel(config)
            model.load_state_dict(start)
            timer = StepTimer(device, common.Progress(label, left[0]))
            left[0] -= 1
            trainer = Trainer(
                model=model,
                args=TrainingArguments(
                    output_dir=out,
                    max_steps=size["steps"],
                    per_device_train_batch_size=size["batch"],
                    per_device_eval_batch_size=size["batch"],
                    report_to="none",
                    save_strategy="no",
                    logging_strategy="no",
                    disable_tqdm=True,
                    use_cpu=device.type == "cpu",
                ),
                train_dataset=data,
                eval_dataset=data,
                callbacks=[SpeedFlagsCallback(train=train, evaluate={"amp": False}), timer],
            )
            trainer.train()
            if name == "speedflags" and not evaluated:
                evaluated.append(trainer.evaluate()["eval_loss"])
                print(f"eval loss (full precision): {evaluated[0]:.4f}")
            return timer.seconds

        runs = {
            name: (lambda label, name=name, train=train: run(name, train, label))
            for name, train in (("fp32", common.FP32), ("speedflags", levers or common.FP32))
        }
        times = common.interleaved(runs, count)
        print(common.speedup_line("tiny GPT-2, HF Trainer", times, levers, device, args.smoke))


if __name__ == "__main__":
    main()
