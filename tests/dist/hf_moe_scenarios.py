"""Hugging Face Mixtral (fused 3-D experts) scenarios, run under torchrun like scenarios.py.

Usage: torchrun --nproc-per-node N tests/dist/hf_moe_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: per-step logged losses, the full final state dict (the
single-device names and shapes: the experts' DTensors gathered), the plan, or the crash.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STEPS  # noqa: E402
from pp_scenarios import gathered_state  # noqa: E402  (merges pipeline stages too)
from scenarios import fit, main, record  # noqa: E402
from tests_hf import make_hf_moe_module  # noqa: E402

import lightning.pytorch as L  # noqa: E402

CLIP = 0.05
# name -> (fix, Trainer kwargs)
SCENARIOS = {
    "mixtral_dp4": ("dp=4,zero=0,ep=1,grad_accum=1", {}),  # exact balance loss under data parallelism
    "mixtral_ep2_zero3": ("dp=4,zero=3,ep=2,grad_accum=1", {}),
    "mixtral_ep4": ("dp=4,zero=0,ep=4,grad_accum=1", {}),
    "mixtral_ep2_clip": ("dp=4,zero=2,ep=2,grad_accum=1", {"gradient_clip_val": CLIP}),
    # a layer per stage; each stage's (gathered) router logits travel to the last stage's balance loss
    "mixtral_pp2_ep2": ("pp=2,dp=2,zero=3,ep=2,grad_accum=1,schedule=gpipe", {}),
    # TP inside each fused expert (gate_up_proj strided on dim 1, down_proj on dim 2), alone and under EP
    "mixtral_tp2": ("dp=2,tp=2,zero=3,ep=1,grad_accum=1", {}),
    "mixtral_tp2_ep2": ("dp=2,tp=2,zero=2,ep=2,grad_accum=1", {"gradient_clip_val": CLIP}),
}
RESUME = "mixtral_ep2_resume"  # saved at step 4, resumed from another init
TP_RESUME = "mixtral_tp2_ep2_resume"  # the same through DCP with the experts' 2-D (ep, tp) strided DTensors
RESUMES = {RESUME: SCENARIOS["mixtral_ep2_zero3"][0], TP_RESUME: "dp=2,tp=2,zero=3,ep=2,grad_accum=1"}


def run(out: Path, name: str) -> None:
    if name in SCENARIOS:
        fix, trainer_kwargs = SCENARIOS[name]
        trainer, module, losses, plan = fit(fix, make=make_hf_moe_module, **trainer_kwargs)
    elif name in RESUMES:
        fix = RESUMES[name]
        ckpts = out / f"ckpts_{name}"
        saver = L.callbacks.ModelCheckpoint(dirpath=ckpts, every_n_train_steps=STEPS // 2, save_top_k=-1)
        fit(fix, make=make_hf_moe_module, enable_checkpointing=True, extra_callbacks=[saver])
        ckpt = ckpts / f"epoch=0-step={STEPS // 2}.ckpt"
        trainer, module, losses, plan = fit(fix, make=make_hf_moe_module, ckpt_path=str(ckpt), seed=123)
    else:
        raise SystemExit(f"unknown scenario {name}")
    record(out, name, losses=losses, state=gathered_state(module), plan=plan)


if __name__ == "__main__":
    main(run)
