"""Hugging Face Trainer: evaluate with bf16 casts of the float32 weights while training under
autocast, through ``SpeedFlagsCallback``'s per-phase model levers.

A tiny GPT-2 (built from a config: nothing is downloaded) trains on synthetic tokens with
``SpeedFlagsCallback(train={"amp": "auto"}, evaluate={"param_dtype": "bf16"})``, evaluating
and saving a checkpoint every few steps. Afterwards the script evaluates once more in float32
to compare, opens the checkpoints the Trainer saved (safetensors) and shows that they are
ordinary float32 checkpoints, and checks that every flag ends as it began.

    python examples/hf_model_levers.py            # a few hundred steps on the CPU
    python examples/hf_model_levers.py --smoke    # tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_common.py
from _common import flags_as_found

from speedflags.integrations.transformers import SpeedFlagsCallback


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic token sequences with a pattern to learn (each token is the one before, +1)."""

    def __init__(self, count: int, seq: int, vocab: int, seed: int) -> None:
        start = torch.randint(0, vocab, (count, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args()
    layers, width, seq, vocab, steps = (1, 32, 16, 64, 4) if args.smoke else (2, 128, 64, 256, 200)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=2, n_positions=seq,
                        vocab_size=vocab, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    callback = SpeedFlagsCallback(train={"amp": "auto"}, evaluate={"param_dtype": "bf16"})
    every = max(steps // 2, 1)
    with flags_as_found(), tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                per_device_eval_batch_size=8, learning_rate=3e-3, report_to="none",
                eval_strategy="steps", eval_steps=every, save_strategy="steps",
                save_steps=every, logging_strategy="no", disable_tqdm=True, use_cpu=True,
            ),
            train_dataset=Tokens(8 * steps, seq, vocab, 0),
            eval_dataset=Tokens(32, seq, vocab, 1),
            callbacks=[callback],
        )  # fmt: skip
        trainer.train()
        bf16_loss = trainer.evaluate()["eval_loss"]
        trainer.remove_callback(callback)  # the same evaluation, in float32
        fp32_loss = Trainer(
            model=model,
            args=TrainingArguments(output_dir=out, per_device_eval_batch_size=8, report_to="none",
                                   disable_tqdm=True, use_cpu=True),
            eval_dataset=Tokens(32, seq, vocab, 1),
        ).evaluate()["eval_loss"]  # fmt: skip
        print(f"evaluation loss with bf16 casts: {bf16_loss:.4f}")
        print(f"evaluation loss in float32:      {fp32_loss:.4f}")
        saved = sorted(Path(out).glob("checkpoint-*/model.safetensors"))
        ordinary = bool(saved) and all(
            t.dtype in (torch.float32, torch.int64) and t.is_contiguous()
            for path in saved
            for t in load_file(str(path)).values()
        )
        print(
            f"{len(saved)} checkpoints saved by the Trainer: float32: {'yes' if ordinary else 'NO'}"
        )
        own = all("_speedflags_own_class" not in type(m).__dict__ for m in model.modules())
        print(f"model's own classes after the run: {'yes' if own else 'NO'}")
        if not (ordinary and own):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
