"""The main job's GPT in a Hugging Face Accelerate loop, planned and parallelised by autopar (extra ``accelerate``).

    torchrun --nproc-per-node 2 examples/accelerate_gpt.py --cpu --steps 20          # 2 CPU processes (gloo)
    accelerate launch --num_processes 8 examples/accelerate_gpt.py                   # plan for 8 GPUs, then train
    accelerate launch --num_processes 8 examples/accelerate_gpt.py --fix tp=2,zero=3
    python examples/accelerate_gpt.py --cpu --steps 5                                # one process
    torchrun --nproc-per-node 2 examples/accelerate_gpt.py --cpu --step-call --fix pp=2   # a pipeline in this loop

``lightning_autopar.accelerate.prepare(accelerator, model, optimizer, loader)`` replaces
``accelerator.prepare(model, optimizer, loader)``: autopar analyses the model, plans it on the discovered cluster
(dp, zero, tp, cp, sp, ep, recompute, offload, compile; pp=1 in a loop that calls backward) and applies the plan
with its own layers on the process group Accelerate set up. The loop below is Accelerate's, unchanged:
``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_``, ``optimizer.step()``,
``accelerator.save_state``. With ``split_batches=True`` (set here) a loader batch is the global batch of one step.
``lightning_autopar.accelerate.accelerator(plan)`` (Accelerate's own FSDP2 / TP from a plan) stays for GPU users
who want Accelerate's implementation.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from lightning_autopar.accelerate import prepare
from lightning_autopar.data import ByteDataset
from lightning_autopar.models import GPT, GPTConfig, lm_loss


def batch_step(acc, model, optimizer, x, y, clip=None, step_call=False):
    """One loader batch of the loop (tests/dist/accelerate_scenarios.py runs this loop too); returns its loss."""
    if step_call:  # every micro-batch's forward and backward (pp > 1: the pipeline schedule), then the step
        loss = model.train_step((x, y), lambda b: lm_loss(model(b[0]), b[1]))
        if clip is not None:
            acc.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    with acc.accumulate(model):  # Accelerate's own loop: optimizer.step() waits for the gradients to sync
        loss = lm_loss(model(x), y)
        acc.backward(loss)
        if clip is not None and acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return loss


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=1, help="loader batches per optimizer step")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--fix", default=None, help="pin plan fields, e.g. 'tp=2' or 'zero=3'")
    parser.add_argument("--cluster", default=None, help="cluster preset or YAML (default: discovered)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo), as Accelerator(cpu=True)")
    parser.add_argument("--save", default=None, help="accelerator.save_state folder at the end")
    parser.add_argument("--step-call", action="store_true",
                        help="the loop calls model.train_step(batch, loss_fn): pp and grad_accum offered")
    args = parser.parse_args()

    acc = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.accumulate,
                      dataloader_config=DataLoaderConfiguration(split_batches=True))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq_len=args.seq_len, layers=4, hidden=128, heads=4, ffn_hidden=512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(ByteDataset(seq_len=args.seq_len), batch_size=args.global_batch, shuffle=True,
                        drop_last=True)
    model, optimizer, loader = prepare(acc, model, optimizer, loader, fix=args.fix, cluster=args.cluster,
                                       step_call=args.step_call)
    acc.print(f"autopar plan applied: {model.autopar.plan.short()}")
    step = 0
    while step < args.steps:
        for x, y in loader:  # this rank's rows of each global batch (--step-call: the whole global batch)
            loss = batch_step(acc, model, optimizer, x, y, args.clip, args.step_call)
            if acc.sync_gradients:
                step += 1
                if step % 10 == 0 or step == args.steps:
                    mean = acc.reduce(loss.detach(), reduction="mean")
                    acc.print(f"step {step:4d}  loss {mean.item():.3f}")
                if step == args.steps:
                    break
    if args.save:
        acc.save_state(args.save)
        acc.print(f"saved to {args.save} (autopar/: the model and optimizer, sharded; loads at any plan)")


if __name__ == "__main__":
    main()
