"""Accelerate scenarios under torchrun (issue 31): ``lightning_autopar.accelerate.prepare`` in Accelerate's own loop.

Usage: torchrun --nproc-per-node N tests/dist/accelerate_scenarios.py OUT_DIR name[,name...]
``Accelerator(cpu=True)`` under torchrun is MULTI_CPU on gloo. Each scenario writes OUT_DIR/<name>.pt on rank 0:
the global loss of every loader batch, the full final state dict (single-device names) and the plan, or the
traceback it crashed with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_gpt import batch_step  # noqa: E402
from common import GLOBAL_BATCH, STEPS, make_data, make_module  # noqa: E402

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from pp_scenarios import gathered_state  # noqa: E402
from scenarios import main, record  # noqa: E402
from tests_hf import make_hf_module  # noqa: E402

CLIP = 0.05  # small enough that every step clips
MOE = {"experts": 4, "top_k": 2}
SCENARIOS = {  # name -> (fix, Accelerator kwargs, loop options)
    # world 4: the cells. The planner's own plan for a tiny HF Llama
    "acc_auto_llama": (None, {}, {"make": "llama"}),
    # tp=2 inside dp=2 with FSDP2 (zero=3), accumulated over 2 loader batches and clipped over both meshes
    "acc_tp2_zero3_accum_clip": ("tp=2,dp=2,zero=3", {"gradient_accumulation_steps": 2}, {"clip": CLIP}),
    # a MoE GPT (4 experts, top 2) with its experts split over 2 expert-parallel ranks
    "acc_moe_ep2": ("dp=4,ep=2", {}, {"model": MOE, "clip": CLIP}),
    # model.train_step(batch, loss_fn) (step_call=True): 2 pipeline stages x 2 data-parallel ranks, 2 micro-batches
    "acc_step_pp2": ("pp=2,dp=2,grad_accum=2", {}, {"step_call": True, "clip": CLIP}),
    # world 2
    "acc_ddp_accum": ("dp={w},zero=0", {"gradient_accumulation_steps": 2}, {}),
    # Accelerate's default batches: each data-parallel rank its own loader batch of GLOBAL_BATCH / dp rows
    "acc_zero3_per_process": ("dp={w},zero=3", {"split_batches": False}, {"per_process": True}),
    # ... and at tp=2 (dp=1) both ranks read the same loader batch of GLOBAL_BATCH rows: the step's global batch
    "acc_tp_per_process": ("tp={w},dp=1", {"split_batches": False}, {}),
    # FSDP2 with 2 micro-batches in one train_step
    "acc_step_zero3_accum": ("dp={w},zero=3,grad_accum=2", {}, {"step_call": True}),
}
MAKERS = {"gpt": make_module, "llama": make_hf_module}  # common's GPT; tests_hf's tiny Llama in a LightningModule


def accelerate_run(fix: str | None, acc_kwargs: dict, clip: float | None = None, per_process: bool = False,
                   step_call: bool = False, model: dict | None = None, make: str = "gpt", steps: int = STEPS,
                   state: Path | None = None, save_at: int = 0, resume: bool = False):
    """The Accelerate loop of examples/accelerate_gpt.py (``batch_step``) on a model ``prepare``d with ``fix``:
    the global loss of each of ``steps`` loader batches. ``save_at``: ``accelerator.save_state(state)`` after that
    many batches; ``resume``: ``accelerator.load_state(state)`` first, then the batches after the saved ones.
    ``make``: the model (``MAKERS``), ``model`` its config's overrides (the GPT's)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from lightning_autopar.accelerate import prepare

    acc_kwargs = dict(acc_kwargs)
    split = acc_kwargs.pop("split_batches", True)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=split), **acc_kwargs)
    L.seed_everything(0, verbose=False)
    module = MAKERS[make](**(model or {}))
    optimizer = module.configure_optimizers()
    world = acc.num_processes
    batch = GLOBAL_BATCH // world if per_process else GLOBAL_BATCH
    data = DataLoader(make_data(), batch_size=batch, shuffle=False, drop_last=True)
    model, optimizer, loader = prepare(acc, module, optimizer, data, fix=fix, step_call=step_call, cluster="cpu",
                                       print_plan=False)
    skip = save_at if resume else 0
    if resume:
        acc.load_state(str(state))
    losses, seen = [], 0
    while len(losses) < steps:
        for x, y in loader:
            seen += 1
            if seen <= skip:
                continue
            loss = batch_step(acc, model, optimizer, x, y, clip, step_call)  # the example's loop
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
            if save_at and not resume and len(losses) == save_at:
                acc.save_state(str(state))
            if len(losses) == steps:
                break
    assert model.autopar.report.global_batch == GLOBAL_BATCH, model.autopar.report.global_batch
    return module, losses, model.autopar.plan.to_dict()


def run(out: Path, name: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if name in SCENARIOS:
        fix, acc_kwargs, loop = SCENARIOS[name]
        module, losses, plan = accelerate_run(fix and fix.format(w=world), acc_kwargs, **loop)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
    elif name == "acc_resume_zero3_to_tp":  # save_state at zero=3 after 4 batches, load_state at tp=2
        state = out / f"{name}_state"
        accelerate_run(f"dp={world},zero=3", {}, steps=4, state=state, save_at=4)
        module, losses, plan = accelerate_run(f"tp={world},dp=1", {}, steps=STEPS - 4, state=state, save_at=4,
                                              resume=True)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
    else:
        raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(run)
