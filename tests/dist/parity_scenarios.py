"""The one plan space: the live strategy and ``autopar plan`` choose the same plan for the same model, cluster
file and batch (tests/test_plan_parity.py). Each scenario runs ``Trainer(strategy=AutoParallelStrategy(
cluster=<file>))`` for one step with nothing fixed and records what it planned (the analysed model spec, the
batch geometry, the best plan and its prediction, the runtime's exclusions); the test then asks the CLI.

Usage: torchrun --nproc-per-node 4 tests/dist/parity_scenarios.py OUT_DIR name[,name...]  (or in a batch)
Scenarios (``SCENARIOS``): a cluster file (``CLUSTERS``, written to OUT_DIR) and our GPT at a sequence length.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path

import lightning.pytorch as L
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96


# name -> (cluster memory GiB, global batch, sequence length, GPT overrides)
SCENARIOS = {
    "long_context": (0.05, 2, 1024, dict(layers=4, hidden=64, heads=4, ffn_hidden=128)),
    "roomy": (74.5, 8, 64, dict(layers=4, hidden=64, heads=4, ffn_hidden=128)),
}


def planned(out: Path, name: str) -> dict:
    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    memory, global_batch, seq, overrides = SCENARIOS[name]
    # the H100 DGX preset with little memory per device, so that activations decide the plan; one file per
    # rank (same contents: no rank reads a file another is writing)
    path = out / f"{name}_r{os.environ['RANK']}.yaml"
    spec = yaml.safe_load((ROOT / "configs/cluster/h100-sxm-dgx.yaml").read_text())
    spec["name"], spec["device"]["memory_gib"], spec["device"]["reserved_gib"] = name, memory, 0.0
    # compile is not what parity is about (tests/test_compile.py checks it) and costs the suite an inductor build
    # per rank: without fused traffic compile=true is never priced faster, so both sides choose eager
    spec["device"]["compile_fuses"] = False
    path.write_text(yaml.safe_dump(spec))
    L.seed_everything(0, verbose=False)
    module = LitGPT(GPTConfig(vocab=VOCAB, seq_len=seq, **overrides), lr=0.01, momentum=0.9)
    tokens = torch.randint(0, VOCAB, (global_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=global_batch, shuffle=False)
    strategy = AutoParallelStrategy(cluster=str(path), print_plan=False, profile=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=False)
    trainer.fit(module, loader)
    report = strategy.report
    return dict(cluster=str(path), spec=dataclasses.asdict(strategy.analysis.spec), plan=strategy.plan.to_dict(),
                predicted=report.best.step_time_s, global_batch=report.global_batch, seq_len=report.seq_len,
                excluded=dict(report.excluded), loss=float(trainer.callback_metrics.get("train_loss", float("nan"))))


def run(out: Path, name: str) -> None:
    """Scenario ``name``: rank 0 writes OUT/<name>.pt, what the live strategy planned or the traceback."""
    try:
        result = planned(out, name)
    except Exception:  # noqa: BLE001 -- recorded for the test to show
        result = dict(error=traceback.format_exc())
    if int(os.environ["RANK"]) == 0:
        torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    from scenarios import main

    main(run)
