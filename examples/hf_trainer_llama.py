"""A tiny Hugging Face Llama trained by the Hugging Face ``Trainer`` on autopar's plan (extras ``hf``, ``accelerate``).

    torchrun --nproc-per-node 4 examples/hf_trainer_llama.py --cpu --steps 20        # 4 CPU processes (gloo)
    torchrun --nproc-per-node 8 examples/hf_trainer_llama.py --fix tp=2,zero=3       # 8 GPUs, two fields pinned
    python examples/hf_trainer_llama.py --cpu --steps 5                               # one process

``lightning_autopar.hf_trainer.AutoparTrainer`` is a ``transformers.Trainer``: autopar analyses the model, plans it
(dp, zero, tp, cp, sp, ep, recompute, offload, compile; pp=1: the Trainer's loop calls backward) and applies the plan
with its own layers when ``train()`` asks for its DataLoader. Everything else is the Trainer's. A step takes
``per_device_train_batch_size x dp x gradient_accumulation_steps`` rows (the ranks of one tp group read the same
rows). Checkpoints go through autopar (``trainer.autopar.save``), so ``save_strategy`` is "no".
"""

from __future__ import annotations

import argparse

import torch

from lightning_autopar.data import ByteDataset
from lightning_autopar.hf_trainer import AutoparTrainer
from lightning_autopar.models.hf import causal_lm
from lightning_autopar.specs import ModelSpec


class ByteRows(torch.utils.data.Dataset):
    """The byte corpus as the Trainer's rows: ``input_ids`` and ``labels`` (the model shifts the labels)."""

    def __init__(self, seq_len: int) -> None:
        self.windows = ByteDataset(seq_len=seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        inputs, _ = self.windows[i]
        return {"input_ids": inputs, "labels": inputs}


def main() -> None:
    from transformers import TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--per-device-batch", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--fix", default=None, help="pin plan fields, e.g. 'tp=2' or 'zero=3'")
    parser.add_argument("--cluster", default=None, help="cluster preset or YAML (default: discovered)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo)")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the plan's precision)")
    parser.add_argument("--save", default=None, help="folder for the model and optimizer at the end (sharded)")
    args = parser.parse_args()

    torch.manual_seed(0)
    spec = ModelSpec(name="llama-tiny", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, ffn_kind="swiglu",
                     vocab=256, seq_len=args.seq_len)
    model = causal_lm(spec)
    training = TrainingArguments(output_dir="hf_trainer_out", per_device_train_batch_size=args.per_device_batch,
                                 gradient_accumulation_steps=args.accumulate, max_steps=args.steps,
                                 learning_rate=3e-3, max_grad_norm=1.0, bf16=args.bf16, logging_steps=10,
                                 save_strategy="no", report_to="none", use_cpu=args.cpu, disable_tqdm=True,
                                 dataloader_drop_last=True)
    trainer = AutoparTrainer(model, training, train_dataset=ByteRows(args.seq_len), fix=args.fix,
                             planner_options={"cluster": args.cluster})
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"autopar plan applied: {trainer.autopar.plan.short()}")
    if args.save:
        trainer.autopar.save(args.save)  # every rank: torch.distributed.checkpoint, loads at any plan


if __name__ == "__main__":
    main()
