"""The main job's GPT with Lightning Fabric and strategy="autopar": a plain PyTorch training loop.

    python examples/fabric_gpt.py                                   # 4 CPU processes (all GPUs with CUDA)
    python examples/fabric_gpt.py --fix tp=2 --steps 40
    python examples/fabric_gpt.py --step-call --fix pp=2         # model.train_step: pipelines in this loop
    fabric run examples/fabric_gpt.py --accelerator cpu --devices 4  # the Fabric CLI (torchrun underneath)

``fabric run`` refuses ``--strategy autopar`` (its --strategy takes a fixed list), so the strategy is named
here in the code; accelerator and devices come from the CLI when it is used. The DataLoader's batch is the
global batch of one optimizer step: setup_dataloaders (called before setup) hands it to the planner, and the
loader it returns yields this rank's rows of each global batch. With ``--step-call`` the loop calls
``model.train_step(batch, loss_fn)`` on the whole global batch instead of forward and backward, so the planner
also offers pipelines (pp) and micro-batches (grad_accum).
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from lightning.fabric.fabric import _is_using_cli
from torch.utils.data import DataLoader

import lightning_autopar  # noqa: F401  (registers strategy="autopar" for Fabric too)
from lightning_autopar.data import ByteDataset
from lightning_autopar.fabric import AutoParallelFabricStrategy
from lightning_autopar.models import GPT, GPTConfig, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--fix", default=None, help="pin plan fields, e.g. 'tp=2,zero=3'")
    parser.add_argument("--cluster", default=None, help="cluster preset or YAML (default: discovered)")
    parser.add_argument("--step-call", action="store_true", help="model.train_step: pp and grad_accum offered")
    args = parser.parse_args()

    pinned = args.fix or args.cluster or args.step_call
    strategy = (AutoParallelFabricStrategy(fix=args.fix, cluster=args.cluster, step_call=args.step_call)
                if pinned else "autopar")
    cuda = torch.cuda.is_available()
    # under `fabric run` the CLI's --accelerator/--devices/--num-nodes apply (Fabric rejects conflicting values)
    devices = {} if _is_using_cli() else dict(accelerator="gpu" if cuda else "cpu",
                                              devices=torch.cuda.device_count() if cuda else 4)
    fabric = Fabric(strategy=strategy, **devices)
    if not _is_using_cli():  # `fabric run` has started the processes already
        fabric.launch()
    fabric.seed_everything(0)

    loader = fabric.setup_dataloaders(
        DataLoader(ByteDataset(seq_len=args.seq_len), batch_size=args.batch_size, shuffle=True, drop_last=True))
    model = GPT(GPTConfig(vocab=256, seq_len=args.seq_len, layers=4, hidden=128, heads=4, ffn_hidden=512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    step = 0
    while step < args.steps:
        for x, y in loader:
            if args.step_call:  # every micro-batch's forward and backward (pp > 1: the pipeline schedule)
                loss = model.train_step((x, y), lambda b: lm_loss(model(b[0]), b[1]))
            else:
                loss = lm_loss(model(x), y)
                fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == args.steps:
                mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
                fabric.print(f"step {step:4d}  loss {mean.item():.3f}")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
