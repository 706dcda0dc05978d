"""Expert parallelism on MoE layers written the plain way (router Linear, ModuleList of experts, the loop in
forward): the test model of plain_moe.py and litgpt's LLaMAMoE, run under torchrun like scenarios.py.

Usage: torchrun --nproc-per-node N tests/dist/plain_moe_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: per-step logged losses, the full final state dict (single-device
names), the plan, or the crash.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_moe import make_dict_moe_module, make_litgpt_moe_module, make_plain_moe_module  # noqa: E402
from pp_scenarios import gathered_state  # noqa: E402  (merges the expert ranks' experts)
from scenarios import fit, main, record  # noqa: E402

CLIP = 0.05
# name -> (model factory, fix, Trainer kwargs)
SCENARIOS = {
    "plain_ep2_zero0": (make_plain_moe_module, "dp=4,zero=0,ep=2,grad_accum=1", {}),
    "plain_ep2_zero3": (make_plain_moe_module, "dp=4,zero=3,ep=2,grad_accum=1", {}),
    "plain_ep4_clip": (make_plain_moe_module, "dp=4,zero=0,ep=4,grad_accum=1", {"gradient_clip_val": CLIP}),
    "plain_tp2_ep2": (make_plain_moe_module, "tp=2,dp=2,zero=3,ep=2,grad_accum=1", {}),
    # experts in a ModuleDict, called by key order from items(): TP splits each, EP keeps the local ones by name
    "dict_tp2_ep2": (make_dict_moe_module, "tp=2,dp=2,zero=3,ep=2,grad_accum=1", {}),
    "litgpt_moe_ep2": (make_litgpt_moe_module, "dp=4,zero=0,ep=2,grad_accum=1", {}),
    # the forward's two passes and the exchange run again in backward (checkpoint recompute); a layer per stage
    "plain_ep2_recompute": (make_plain_moe_module, "dp=4,zero=3,ep=2,grad_accum=1,recompute=full", {}),
    "plain_pp2_ep2": (make_plain_moe_module, "pp=2,dp=2,zero=3,ep=2,grad_accum=1,schedule=gpipe", {}),
}


def run(out: Path, name: str) -> None:
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name}")
    make, fix, trainer_kwargs = SCENARIOS[name]
    trainer, module, losses, plan = fit(fix, make=make, **trainer_kwargs)
    record(out, name, losses=losses, state=gathered_state(module), plan=plan)


if __name__ == "__main__":
    main(run)
