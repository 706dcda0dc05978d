"""Set-up profiling and trials under torchrun (``AutoParallelStrategy(trials=K, profile=...)``), one launch.

Usage: torchrun --nproc-per-node 4 tests/dist/trials_scenarios.py OUT_DIR name[,name...]
Scenarios (run in this order; "cached" reads the cache "trials" wrote):
  trials  dp=4 zero=3 with mbs in [1, 4] (global batch 16: ga 4 vs 1), a short profile and trials=2
  fixed   the same run with the plan trials chose fixed, no profile and no trials (what trials must not change)
  cached  "trials" again on the same cache: nothing measured, no trial, the same plan
  nocache trials=1 with profile_cache=False: nothing written (the default cache is OUT_DIR/default_cache here)
  fabric  the Fabric strategy, DataLoader first, a LightningModule's training_step for the trials
  tp      trials=2 of tensor-parallel plans, then the real run on one of them: the run reuses the trial's mesh
          and its process groups (topology.mesh builds each mesh shape once per process group)
  quick   the default settings on a run of QUICK_MIN_STEPS steps (stopped after its first): the quick measurement
Each writes OUT_DIR/<name>_r<rank>.pt: the applied plan, the report's trials and best prediction, the set-up
outcome, the per-step losses, the final state and the RNG states after fit (or the traceback)."""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import traceback
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import fit, full_state  # noqa: E402

GLOBAL_BATCH, STEPS = 16, 3
FIX = "dp=4,zero=3,dp_shard=4"
RESTRICT = {"mbs": [1, 4], "recompute": ["none"]}


def fabric_run() -> dict:
    """The Fabric strategy with a LightningModule (a trial runs its training_step): DataLoader first, trials=2
    with a short profile; the plans differ in recompute (Fabric keeps one micro-batch per step)."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from common import make_data, make_module
    from lightning_autopar.fabric import AutoParallelFabricStrategy
    from lightning_autopar.models.gpt import lm_loss

    torch.manual_seed(0)
    strategy = AutoParallelFabricStrategy(fix=FIX, cluster="cpu", print_plan=False, trials=2, profile=True,
                                          profile_budget_s=1.0, profile_cache=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    module = make_module()
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=GLOBAL_BATCH, shuffle=False))
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    for x, y in loader:  # the set-up left a working model and optimizer
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    report = strategy.report
    return dict(plan=strategy.plan.to_dict(), trials=[dataclasses.asdict(t) for t in report.trials],
                outcome=dataclasses.asdict(strategy.setup_outcome), profiled=report.profile is not None,
                loss=float(loss))


def outcome(out: Path, name: str) -> dict:
    if name == "fabric":
        return fabric_run()
    cache = out / "cache"
    kwargs: dict = dict(restrict=RESTRICT, profile_cache=str(cache))
    fix = FIX
    if name == "trials":
        kwargs.update(trials=2, profile=True, profile_budget_s=2.0)
    elif name == "fixed":
        chosen = torch.load(out / "trials_r0.pt", weights_only=False)["plan"]
        fix = f"{FIX},mbs={chosen['mbs']},grad_accum={chosen['grad_accum']}"
        kwargs.update(trials=0, profile=False)
    elif name == "cached":
        kwargs.update(trials=2, profile=True, profile_budget_s=2.0)
    elif name == "nocache":
        kwargs.update(trials=1, profile_cache=False)
    elif name == "quick":
        import lightning.pytorch as L

        from lightning_autopar.runtime.trial import QUICK_MIN_STEPS

        class StopAtOnce(L.Callback):  # the set-up is what is checked: one step of the run is enough
            def on_train_batch_end(self, trainer, *args):
                trainer.should_stop = True

        kwargs["profile_cache"] = str(out / "quick_cache")
        trainer, module, losses, plan = fit(fix, steps=QUICK_MIN_STEPS, strategy_kwargs=kwargs,
                                            batch_size=GLOBAL_BATCH, extra_callbacks=[StopAtOnce()])
        return dict(plan=plan, losses=losses, outcome=dataclasses.asdict(trainer.strategy.setup_outcome),
                    source=trainer.strategy.report.source, trials=[dataclasses.asdict(t) for t in
                                                                  trainer.strategy.report.trials])
    elif name == "tp":
        fix = "tp=2,dp=2,zero=0"
        kwargs.update(trials=2, profile=False, profile_cache=False, restrict={"mbs": [1, 2]})
    else:
        raise SystemExit(f"unknown scenario {name}")
    trainer, module, losses, plan = fit(fix, steps=STEPS, strategy_kwargs=kwargs, batch_size=GLOBAL_BATCH)
    strategy = trainer.strategy
    report = strategy.report
    return dict(plan=plan, losses=losses, state=full_state(module),
                rng=(torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()),
                trials=[dataclasses.asdict(t) for t in report.trials],
                predicted=report.best.step_time_s, best_plan=report.best.plan.to_dict(),
                outcome=dataclasses.asdict(strategy.setup_outcome), spec=report.model,
                global_batch=report.global_batch, seq_len=report.seq_len,
                profiled=report.profile is not None and bool(report.profile.collectives or report.profile.blocks),
                cache_files=sorted(str(p.relative_to(out)) for p in (out / "default_cache").rglob("*")))


def run(out: Path, name: str) -> None:
    """Scenario ``name``: each rank writes OUT/<name>_r<rank>.pt (its outcome or the traceback)."""
    import torch.distributed as dist

    os.environ["AUTOPAR_CACHE"] = str(out / "default_cache")  # profile_cache=None resolves here (this scenario)
    (out / "default_cache").mkdir(parents=True, exist_ok=True)
    try:
        result = outcome(out, name)
    except Exception:  # noqa: BLE001 - the test reports the traceback
        result = {"crash": traceback.format_exc()}
    torch.save(result, out / f"{name}_r{os.environ['RANK']}.pt")
    if dist.is_initialized():
        dist.barrier()  # "fixed" reads what rank 0 of "trials" wrote


if __name__ == "__main__":
    from scenarios import main

    main(run)
