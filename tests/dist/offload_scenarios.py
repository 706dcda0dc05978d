"""Offload (issue 17) under strategy="autopar" at world 4: offload=params (FSDP2's CPUOffloadPolicy) at dp=4
zero=3, at tp=2 x dp=2 zero=3 and in two pipeline stages; offload=optimizer (host mirrors, ``HostStep``) at
dp=2 x pp=2 zero=2 and at dp=4 zero=1 with grad_accum=2 and gradient clipping; a sharded checkpoint saved with
offload=optimizer resumed with offload=none and the reverse; the one-line refusals. Compared with the
single-process loop in tests/test_offload.py.

Usage: torchrun --nproc-per-node 4 tests/dist/offload_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# scenario -> (plan fields, Trainer arguments)
PLANS = {
    "params_dp4_zero3": ("dp=4,zero=3,offload=params", {}),
    "params_tp2_dp2_zero3": ("tp=2,dp=2,zero=3,offload=params", {}),
    "params_pp2_dp2_zero3": ("pp=2,dp=2,zero=3,schedule=1f1b,mbs=2,grad_accum=2,offload=params", {}),
    "optimizer_pp2_dp2_zero2": ("pp=2,dp=2,zero=2,schedule=1f1b,mbs=2,grad_accum=2,offload=optimizer", {}),
    "optimizer_dp4_zero1_accum_clip": ("dp=4,zero=1,mbs=1,grad_accum=2,offload=optimizer",
                                       {"gradient_clip_val": 0.05}),
}
# scenario -> (plan saved with, plan resumed with): saved at step 4 of 8, resumed from another initialisation
RESUMES = {
    "resume_optimizer_to_none": ("dp=4,zero=2,offload=optimizer", "dp=4,zero=2,offload=none"),
    "resume_none_to_optimizer": ("dp=4,zero=2,offload=none", "dp=4,zero=2,offload=optimizer"),
}
REFUSALS = {
    "refuse_zero0": "dp=4,zero=0,offload=optimizer",
}


def hosted(trainer) -> dict:
    """What runs on the host: optimizers stepping host mirrors (and how many), FSDP units offloading."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from lightning_autopar.parallel.offload import HostStep

    steps = [getattr(getattr(o, "_optimizer", o).step, "__self__", None) for o in trainer.strategy.optimizers]
    units = [m for m in trainer.lightning_module.modules() if isinstance(m, FSDPModule)]
    offloading = [any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in u._get_fsdp_state()._fsdp_param_groups)
                  for u in units]
    return {"host_steps": [len(s.mirrors) if isinstance(s, HostStep) else None for s in steps],
            "units": len(units), "units_offloading": sum(offloading)}


def run(out: Path, name: str) -> None:
    import lightning.pytorch as L

    from common import STEPS
    from pp_scenarios import gathered_state
    from scenarios import fit, record, record_error

    if name in REFUSALS:
        record_error(out, name, REFUSALS[name])
        return
    if name in RESUMES:
        saved_with, resumed_with = RESUMES[name]
        ckpts = out / f"{name}_ckpts"
        saver = L.callbacks.ModelCheckpoint(dirpath=ckpts, every_n_train_steps=STEPS // 2, save_top_k=-1)
        fit(saved_with, enable_checkpointing=True, extra_callbacks=[saver])
        ckpt = ckpts / f"epoch=0-step={STEPS // 2}.ckpt"
        trainer, module, losses, plan = fit(resumed_with, ckpt_path=str(ckpt), seed=123)
    else:
        fix, trainer_kwargs = PLANS[name]
        trainer, module, losses, plan = fit(fix, **trainer_kwargs)
    record(out, name, losses=losses, state=gathered_state(module), plan=plan, hosted=hosted(trainer))


if __name__ == "__main__":
    from scenarios import main

    main(run)
