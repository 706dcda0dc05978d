"""Zero-bubble and DualPipe schedules (interleaved-zb, zbv, dualpipev), run under torchrun like pp_scenarios.py.

Usage: torchrun --nproc-per-node N tests/dist/schedule_scenarios.py OUT_DIR name[,name...]
Training scenarios write OUT_DIR/<name>.pt on rank 0: per-step logged losses, the full final state dict
(single-device names), the plan; ``*_refused`` scenarios record the one-line error; ``zbv_validation`` records the
val_loss every rank saw after a V-placed pipeline (last stage on rank 0) ran forward-only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp_scenarios import MOE, PP4, gathered_state  # noqa: E402
from scenarios import fit, main, record, record_error  # noqa: E402

# name -> (fix, model config overrides)
SCENARIOS = {
    "pp2_zbv": ("pp=2,dp=1,grad_accum=4,schedule=zbv,vpp=2", PP4),
    "pp2_zbv_ga2": ("pp=2,dp=1,grad_accum=2,schedule=zbv,vpp=2", PP4),  # fewer than 2*pp-1: torch pads the V
    "pp2_izb": ("pp=2,dp=1,grad_accum=4,schedule=interleaved-zb,vpp=2", PP4),
    "pp2_dualpipev": ("pp=2,dp=1,grad_accum=4,schedule=dualpipev,vpp=2", PP4),
    # MoE: the balance losses of every chunk reach the last chunk's loss (on rank 0 in the V)
    "pp2_moe_zbv": ("pp=2,dp=1,grad_accum=4,schedule=zbv,vpp=2", {**MOE, **PP4}),
    "pp2_moe_dualpipev": ("pp=2,dp=1,grad_accum=4,schedule=dualpipev,vpp=2", {**MOE, **PP4}),
    "pp2_dp2_izb_zero1": ("pp=2,dp=2,zero=1,grad_accum=2,schedule=interleaved-zb,vpp=2", PP4),
    "pp2_dp2_izb_zero3": ("pp=2,dp=2,zero=3,grad_accum=2,schedule=interleaved-zb,vpp=2", PP4),
    "pp2_dp2_zbv_zero3": ("pp=2,dp=2,zero=3,grad_accum=2,schedule=zbv,vpp=2", PP4),
    "pp2_tp2_zbv": ("pp=2,tp=2,dp=1,grad_accum=4,schedule=zbv,vpp=2", PP4),
    # micro-batches of one row: SP's gathered chunk output is a view, which the split backward cannot detach
    "pp2_tp2_sp_dualpipev_mbs1": ("pp=2,tp=2,dp=1,sp=true,grad_accum=8,schedule=dualpipev,vpp=2", PP4),
}
# forced plans torch cannot run: one ConfigError line
REFUSED = {
    "dualpipev_refused": ("pp=2,dp=1,grad_accum=2,schedule=dualpipev,vpp=2", PP4),  # needs >= 2*pp micro-batches
    "izb_refused": ("pp=2,dp=1,grad_accum=1,schedule=interleaved-zb,vpp=2", PP4),  # micro-batches % pp
    # the split backward recomputes a checkpointed block twice; the composable checkpoint allows once
    "zbv_recompute_refused": ("pp=2,dp=1,grad_accum=4,schedule=zbv,vpp=2,recompute=full", PP4),
}


def run(out: Path, name: str) -> None:
    if name in SCENARIOS:
        fix, model = SCENARIOS[name]
        trainer, module, losses, plan = fit(fix, model_kwargs=model)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
    elif name in REFUSED:
        fix, model = REFUSED[name]
        record_error(out, name, fix, model_kwargs=model)
    elif name == "zbv_validation":
        import torch.distributed as dist
        from torch.utils.data import DataLoader

        from common import GLOBAL_BATCH, make_data

        trainer, module, _, plan = fit("pp=2,dp=1,grad_accum=4,schedule=zbv,vpp=2", steps=2, model_kwargs=PP4)
        metrics = trainer.validate(module, DataLoader(make_data(), batch_size=GLOBAL_BATCH), verbose=False)
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, float(metrics[0]["val_loss"]))
        record(out, name, val_losses=values, state=gathered_state(module), plan=plan,
               rank=int(os.environ["RANK"]))
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
