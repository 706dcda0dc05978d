"""Memory truth: each scenario trains our GPT (hidden 128, 4 layers, seq 256, AdamW) two steps under one plan,
measures the second step's peak on every rank with MemTracker (profile/memory.peak_memory_callback, DDP's
buckets added: MemTracker cannot see them) and records the maximum over ranks beside the planner's
``memory_gib_per_device`` for the same plan on the ``cpu`` cluster, less its ``reserved_gib`` (a per-process
constant the measurement does not see). Compared in tests/test_memory_truth.py.

Usage: torchrun --nproc-per-node 4 tests/dist/memory_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEQ, VOCAB, GLOBAL_BATCH, STEPS = 256, 256, 4, 2
BASE = "zero=0,tp=1,pp=1,ep=1,cp=1,sp=false,mbs=1,grad_accum=1,recompute=none,recompute_every=1,precision=fp32"
PLANS = {  # scenario -> plan fields over BASE
    "ddp": "dp=4",
    "zero2": "dp=4,zero=2",
    "zero3": "dp=4,zero=3",
    "tp2_dp2": "dp=2,tp=2,mbs=2",
    "pp2_1f1b": "dp=2,pp=2,grad_accum=2,schedule=1f1b",
}


def make_module():
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    cfg = GPTConfig(vocab=VOCAB, seq_len=SEQ, layers=4, hidden=128, heads=4, ffn_hidden=512)
    return LitGPT(cfg, optimizer="adamw", lr=1e-3)


def loader():
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=gen)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH, shuffle=False)


def run(out: Path, name: str) -> None:
    import lightning.pytorch as L
    import torch.distributed as dist

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.profile.memory import ddp_bucket_bytes, peak_memory_callback, with_untracked
    from scenarios import record

    L.seed_everything(0, verbose=False)
    module = make_module()
    callback = peak_memory_callback(measure_batches=(STEPS - 1,))
    strategy = AutoParallelStrategy(fix=f"{BASE},{PLANS[name]}", cluster="cpu", print_plan=False, profile=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(module, loader())
    measured = with_untracked(callback.peak, "ddp_buckets", ddp_bucket_bytes(module)).to_dict()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, measured)
    best = strategy.report.best
    record(out, name, measured=max(rows, key=lambda r: r["peak_gib"]), plan=best.plan.short(),
           predicted_gib=best.memory_gib_per_device - strategy.report.cluster.device.reserved_gib)


if __name__ == "__main__":
    from scenarios import main

    main(run)
