"""Ecosystem scenarios under torchrun: the Fabric strategy and a Hugging Face model under the Trainer strategy.

Usage: torchrun --nproc-per-node N tests/dist/ecosystem_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: per-step global losses, the full final state dict (the
single-device names) and the plan, or the traceback it crashed with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOBAL_BATCH, STEPS, make_data, make_module  # noqa: E402

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_autopar  # noqa: E402,F401
from scenarios import LossCollector, full_state, main, record  # noqa: E402

FABRIC_FIXES = {"fabric_dp": "dp={w},zero=3", "fabric_tp": "tp={w},dp=1", "fabric_ddp": "dp={w},zero=0"}


def fabric_run(fix: str, steps: int = STEPS):
    """The reference loop of common.reference_run, written for Fabric with strategy autopar."""
    from lightning.fabric import Fabric

    from lightning_autopar.fabric import AutoParallelFabricStrategy
    from lightning_autopar.models import lm_loss

    world = int(os.environ["WORLD_SIZE"])
    strategy = AutoParallelFabricStrategy(fix=fix, cluster="cpu", print_plan=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    module = make_module()
    optimizer = module.configure_optimizers()
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=GLOBAL_BATCH, shuffle=False))
    model, optimizer = fabric.setup(module, optimizer)
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            assert x.shape[0] == GLOBAL_BATCH // strategy.plan.dp, x.shape  # this rank's slice
            loss = lm_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if len(losses) == steps:
                break
    return module, losses, strategy.plan.to_dict()


def hf_fit(fix: str, steps: int = STEPS):
    from lightning_autopar import AutoParallelStrategy
    from tests_hf import make_hf_module

    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    module = make_hf_module()
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[collector])
    trainer.fit(module, DataLoader(make_data(), batch_size=GLOBAL_BATCH, shuffle=False))
    return module, collector.losses, strategy.plan.to_dict()


def run(out: Path, name: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if name in FABRIC_FIXES:
        module, losses, plan = fabric_run(FABRIC_FIXES[name].format(w=world))
    elif name == "hf_llama":
        module, losses, plan = hf_fit(f"dp={world},zero=3")
    elif name == "hf_llama_tp":  # Hugging Face attention split by heads, the model unchanged
        module, losses, plan = hf_fit(f"tp={world},dp=1")
    else:
        raise SystemExit(f"unknown scenario {name}")
    record(out, name, losses=losses, state=full_state(module), plan=plan)


if __name__ == "__main__":
    main(run)
