"""The main job's GPT under Hugging Face Accelerate, parallelised by an autopar plan (GPUs; extra ``accelerate``).

    accelerate launch --num_processes 8 examples/accelerate_gpt.py                 # plan for 8 GPUs, then train
    accelerate launch --num_processes 8 examples/accelerate_gpt.py --fix dp=8,zero=3,dp_shard=4
    torchrun --nproc-per-node 8 examples/accelerate_gpt.py                          # the same through torchrun
    python examples/accelerate_gpt.py --steps 5                                     # one process (CPU smoke run)

autopar plans on the discovered cluster; ``lightning_autopar.accelerate`` turns the plan into a ParallelismConfig
(dp_replicate x dp_shard [x tp x cp]) plus an FSDP2 plugin, mixed precision and gradient accumulation; the
DataLoader holds one micro-batch per process (plan.mbs). Accelerate's TP needs a transformers model loaded with
``tp_plan="auto"``, so this example (a plain nn.Module) plans without TP; pipeline and expert parallelism have
no Accelerate counterpart. Accelerate refuses a ParallelismConfig on several CPU processes: there, use
examples/train_gpt.py or examples/fabric_gpt.py (strategy="autopar").
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader

import lightning_autopar
from lightning_autopar.accelerate import accelerate_mapping, accelerator
from lightning_autopar.data import ByteDataset
from lightning_autopar.launch import format_env_hints, env_hints
from lightning_autopar.models import GPT, GPTConfig, lm_loss
from lightning_autopar.specs import load_cluster_spec

# What Accelerate can express for a plain nn.Module (see lightning_autopar/accelerate.py).
ACCELERATE_SPACE = {"tp": [1], "pp": [1], "ep": [1], "cp": [1], "sp": [False], "recompute": ["none", "full"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--fix", default=None, help="pin plan fields, e.g. 'zero=3'")
    parser.add_argument("--cluster", default=None, help="cluster preset (default: discovered)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    config = GPTConfig(vocab=256, seq_len=args.seq_len, layers=4, hidden=128, heads=4, ffn_hidden=512)
    if args.cluster:
        cluster = load_cluster_spec(args.cluster, nodes=world // local, devices_per_node=local)
    else:
        from lightning_autopar.topology.discover import discover_cluster

        cluster = discover_cluster() if world > 1 else load_cluster_spec("cpu", nodes=1, devices_per_node=1)
    report = lightning_autopar.plan(GPT(config), cluster, global_batch=args.global_batch, seq_len=args.seq_len,
                                    fix=args.fix, restrict=ACCELERATE_SPACE, top=3)
    plan = report.best.plan
    mapping = accelerate_mapping(plan)

    acc = accelerator(plan)  # raises one line where Accelerate refuses the plan
    if acc.is_main_process:
        report.print_table()
        print(f"autopar -> accelerate: {plan.short()} => parallelism {mapping.parallelism}, fsdp {mapping.fsdp}, "
              f"mixed_precision {mapping.mixed_precision}, accumulation {mapping.gradient_accumulation_steps}, "
              f"batch per process {mapping.per_process_batch_size}" + "".join(f"; {n}" for n in mapping.notes))
        for line in format_env_hints(env_hints(plan, cluster)):
            print(f"  {line}")

    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(ByteDataset(seq_len=args.seq_len), batch_size=mapping.per_process_batch_size, shuffle=True,
                        drop_last=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    step = 0
    while step < args.steps:
        for x, y in loader:
            with acc.accumulate(model):
                loss = lm_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if acc.sync_gradients:
                step += 1
                if step % 10 == 0 or step == args.steps:
                    mean = acc.reduce(loss.detach(), reduction="mean")
                    acc.print(f"step {step:4d}  loss {mean.item():.3f}")
                if step == args.steps:
                    break
    acc.end_training()


if __name__ == "__main__":
    main()
