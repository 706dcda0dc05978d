"""Pipeline, expert-parallel and recompute scenarios, run under torchrun like scenarios.py.

Usage: torchrun --nproc-per-node N tests/dist/pp_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: per-step logged losses, the full final state dict gathered
from every stage / expert rank (single-device names), the plan, or the crash.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STEPS  # noqa: E402
from scenarios import fit, main, record  # noqa: E402

import lightning.pytorch as L  # noqa: E402

PP4 = {"layers": 4}  # pp=2 (x vpp=2) scenarios
PP8 = {"layers": 8}  # pp=4 (x vpp=2) scenarios
MOE = {"experts": 4, "top_k": 2}

# name -> (fix, model config overrides[, Trainer kwargs])
CLIP = {"gradient_clip_val": 0.05}
SCENARIOS = {
    "pp2_gpipe": ("pp=2,dp=1,grad_accum=4,schedule=gpipe", PP4),
    "pp2_1f1b": ("pp=2,dp=1,grad_accum=4,schedule=1f1b", PP4),
    "pp2_interleaved": ("pp=2,dp=1,grad_accum=4,schedule=interleaved,vpp=2", PP4),
    "recompute_full": ("tp=2,dp=1,recompute=full", {}),
    "recompute_selective": ("dp=2,zero=3,recompute=selective", {}),
    "pp4_gpipe": ("pp=4,dp=1,grad_accum=4,schedule=gpipe", PP8),
    "pp4_1f1b": ("pp=4,dp=1,grad_accum=4,schedule=1f1b", PP8),
    "pp4_interleaved": ("pp=4,dp=1,grad_accum=4,schedule=interleaved,vpp=2", PP8),
    "pp2_dp2_zero0": ("pp=2,dp=2,zero=0,grad_accum=2,schedule=1f1b", PP4),
    "pp2_dp2_zero3": ("pp=2,dp=2,zero=3,grad_accum=2,schedule=1f1b", PP4, CLIP),
    "pp2_tp2": ("pp=2,tp=2,dp=1,grad_accum=4,schedule=1f1b", PP4),
    "ep2": ("dp=4,ep=2,zero=3,grad_accum=1", MOE, CLIP),
    "ep2_zero0": ("dp=4,ep=2,zero=0,grad_accum=1,recompute=selective", MOE),
    "ep4_full": ("dp=4,ep=4,zero=3,grad_accum=1,recompute=full", MOE),
    "moe_dp4": ("dp=4,ep=1,zero=2,grad_accum=1", MOE),
    "ep2_tp2": ("dp=2,ep=2,tp=2,zero=3,grad_accum=1", MOE),
    "ep4": ("dp=4,ep=4,zero=0,grad_accum=1", MOE),
    "pp2_tp2_dp2": ("pp=2,tp=2,dp=2,zero=3,grad_accum=2,schedule=1f1b", PP4),
    # MoE under pipeline parallelism: the balance losses of every stage reach the last stage's loss
    "pp2_moe_1f1b": ("pp=2,dp=1,grad_accum=4,schedule=1f1b", {**MOE, **PP4}),
    "pp2_moe_interleaved": ("pp=2,dp=1,grad_accum=4,schedule=interleaved,vpp=2", {**MOE, **PP4}),
    "pp2_ep2": ("pp=2,dp=2,ep=2,zero=3,grad_accum=2,schedule=1f1b", {**MOE, **PP4}, CLIP),
    "pp2_tp2_moe_recompute": ("pp=2,tp=2,dp=1,grad_accum=4,schedule=1f1b,recompute=full", {**MOE, **PP4}),
}
RESUME = {
    "resume_pp": ("pp=2,dp=2,zero=3,grad_accum=2,schedule=1f1b", PP4),
    "resume_ep": ("dp=4,ep=2,zero=3,grad_accum=1", MOE),
    "resume_pp_ep": ("pp=2,dp=2,ep=2,zero=3,grad_accum=2,schedule=1f1b", {**MOE, **PP4}),
}


LITGPT_FIX = "pp=2,dp=1,grad_accum=4,schedule=interleaved,vpp=2"
# forward-only validation scenarios -> model config
VALIDATION = {"pp_validation": PP4, "pp_moe_validation": {**MOE, **PP4}}


def gathered_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict under the single-device names: each rank's part (full over its data / tensor
    parallel meshes), merged over pipeline stages and expert-parallel ranks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    mine = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(module, options=opts).items()}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def run(out: Path, name: str) -> None:
    if name in SCENARIOS:
        fix, model, *trainer_kwargs = SCENARIOS[name]
        trainer, module, losses, plan = fit(fix, model_kwargs=model, **(trainer_kwargs or [{}])[0])
        record(out, name, losses=losses, state=gathered_state(module), plan=plan,
               layers_per_stage=getattr(trainer.strategy.report.best, "layers_per_stage", None))
    elif name in RESUME:
        fix, model = RESUME[name]
        saver = L.callbacks.ModelCheckpoint(dirpath=out / f"ckpts_{name}", every_n_train_steps=STEPS // 2,
                                            save_top_k=-1)
        fit(fix, model_kwargs=model, enable_checkpointing=True, extra_callbacks=[saver])
        ckpt = out / f"ckpts_{name}" / f"epoch=0-step={STEPS // 2}.ckpt"
        trainer, module, losses, plan = fit(fix, model_kwargs=model, ckpt_path=str(ckpt), seed=123)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
    elif name == "litgpt_pp2":  # litgpt's GPT, unchanged, split into 4 chunks (interleaved)
        from tests_litgpt import make_litgpt_module

        trainer, module, losses, plan = fit(LITGPT_FIX, make=make_litgpt_module)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
    elif name in VALIDATION:
        # forward-only validation through the pipeline: the same val_loss reaches every rank
        import torch.distributed as dist
        from torch.utils.data import DataLoader, Subset

        from common import GLOBAL_BATCH, make_data, make_module
        from lightning_autopar import AutoParallelStrategy

        L.seed_everything(0, verbose=False)
        module = make_module(**VALIDATION[name])
        strategy = AutoParallelStrategy(fix="pp=2,dp=1,grad_accum=4,schedule=1f1b", cluster="cpu", print_plan=False)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=2,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, limit_val_batches=2, num_sanity_val_steps=1,
                            val_check_interval=2)
        loader = DataLoader(make_data(), batch_size=GLOBAL_BATCH)
        trainer.fit(module, loader, DataLoader(make_data(), batch_size=GLOBAL_BATCH))
        values: list = [None] * dist.get_world_size()
        dist.all_gather_object(values, float(trainer.callback_metrics["val_loss"]))
        # predict: forward-only too; the logits come out on the last stage's rank
        module.predict_step = lambda batch, batch_idx: module(batch[0])
        preds = trainer.predict(module, DataLoader(Subset(make_data(), range(GLOBAL_BATCH)), batch_size=GLOBAL_BATCH))
        predictions: list = [None] * dist.get_world_size()
        dist.all_gather_object(predictions, preds[0] if preds and preds[0] is not None else None)
        # validate alone with a fresh Trainer and module: planned from the validation loader's batch
        L.seed_everything(0, verbose=False)
        fresh = make_module(**VALIDATION[name])
        alone = L.Trainer(strategy=AutoParallelStrategy(fix="pp=2,dp=1", cluster="cpu", print_plan=False),
                          accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), logger=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
        alone_loss = alone.validate(fresh, DataLoader(make_data(), batch_size=GLOBAL_BATCH), verbose=False)[0]["val_loss"]
        record(out, name, val_losses=values, state=gathered_state(module), predictions=predictions,
               validate_alone=alone_loss)
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
