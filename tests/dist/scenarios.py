"""Training scenarios run under torchrun by the equivalence tests; one process group, several scenarios.

Usage: torchrun --nproc-per-node N tests/dist/scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: per-step logged losses, the full final state dict (as the
single-device model's names), the chosen plan, or the one-line error it raised.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOBAL_BATCH, STEPS, make_data, make_module, settled  # noqa: E402

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_autopar  # noqa: E402,F401  (registers "autopar")
from lightning_autopar import AutoParallelStrategy, AutoparError  # noqa: E402


class LossCollector(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(module, options=opts).items()}


def fit(fix, steps=STEPS, ckpt_path=None, seed=0, model_kwargs=None, strategy_kwargs=None, batch_size=GLOBAL_BATCH,
        make=make_module, **trainer_kwargs):
    world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])  # torchrun's, else an srun step's
    L.seed_everything(seed, verbose=False)
    module = make(**(model_kwargs or {}))
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False, **(strategy_kwargs or {}))
    cbs = trainer_kwargs.pop("extra_callbacks", [])
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer_kwargs.setdefault("logger", False)
    # as a multi-node user writes it: processes per node x nodes
    devices = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or world)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=world // devices, max_steps=steps,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[collector, *cbs], **trainer_kwargs,
    )
    loader = DataLoader(make_data(), batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module, collector.losses, strategy.plan.to_dict()


def record(out: Path, name: str, **payload) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(payload, out / f"{name}.pt")


FIXES = {
    "dp_zero0": "dp={w},zero=0",
    "dp_zero2": "dp={w},zero=2",
    "dp_zero3": "dp={w},zero=3",
    "hsdp": "dp={w},zero=3,dp_shard=2",
    "tp": "tp={w},dp=1",
    "tp2_dp2_zero3": "tp=2,dp=2,zero=3",
    "tp2_dp2_accum": "tp=2,dp=2,zero=3,grad_accum=2",
    "dp_accum": "dp={w},zero=0,grad_accum={ga},mbs=1",
    "dp_zero2_accum": "dp={w},zero=2,grad_accum={ga},mbs=1",  # parameters kept unsharded across micro-batches
    "auto": None,
}


def record_error(out: Path, name: str, *args, **kwargs) -> None:
    """Record the one-line AutoparError that ``fit(*args, **kwargs)`` is expected to raise (or None)."""
    try:
        fit(*args, **kwargs)
    except AutoparError as err:
        record(out, name, error=str(err), kind=type(err).__name__)
    else:
        record(out, name, error=None)


def broadcast_states() -> dict:
    """runtime.group.broadcast_module on a model each rank builds from its own seed: fp32, fp64 and bool tensors,
    a tied weight and a non-contiguous one, buckets of 64 and 40 bytes (several per dtype; the non-contiguous one
    alone) and the default size; every rank's tensors after it (gathered to rank 0) and rank 0's before."""
    import torch.distributed as dist

    from lightning_autopar.runtime.group import broadcast_module

    if not dist.is_initialized():  # the first scenario of a launch
        dist.init_process_group("gloo")

    def build() -> torch.nn.Module:
        torch.manual_seed(int(os.environ["RANK"]))
        model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False), torch.nn.Linear(7, 3))
        model[1].weight = model[0].weight  # tied
        model.register_buffer("scale", torch.randn(5, dtype=torch.float64))
        model.register_buffer("mask", torch.rand(6) > 0.5)
        model.register_buffer("strided", torch.randn(4, 6)[:, ::2])
        return model

    states = {}
    for bucket in (64, 40, None):  # 40 bytes: the non-contiguous buffer (48) alone in its bucket
        model = build()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        differed = [torch.empty_like(before["0.weight"]) for _ in range(dist.get_world_size())]
        dist.all_gather(differed, before["0.weight"])
        broadcast_module(model, *([bucket] if bucket else []))
        after = {}
        for key, value in model.state_dict().items():
            value = value.to(torch.float64)  # gloo gathers no bool
            gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, value)
            after[key] = gathered
        states[f"bucket_{bucket}"] = {"before": before, "after": after, "differed": differed,
                                      "tied": model[1].weight is model[0].weight}
    return states


def mesh_groups() -> dict:
    """Several plans' meshes built in one process (as trials and re-planning do), every rank's view gathered: per
    layout and mesh dimension (plus "dp_flat" and the expert meshes), the group's name, its global ranks and the
    sum of the ranks' numbers all-reduced over it."""
    import torch.distributed as dist

    from lightning_autopar.specs import Plan
    from lightning_autopar.topology.mesh import build_mesh

    if not dist.is_initialized():  # the first scenario of a launch
        dist.init_process_group("gloo")
    plans = {"tp2_dp2": Plan(tp=2, dp=2), "pp2_dp2": Plan(pp=2, dp=2), "dp4": Plan(dp=4, zero=3),
             "cp2_hsdp": Plan(cp=2, dp=2, zero=3, dp_shard=1), "dp4_ep2": Plan(dp=4, zero=3, ep=2)}
    seen: dict = {}
    for label, plan in plans.items():
        layout = build_mesh(plan, "cpu")
        meshes = {**{d: layout[d] for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp_flat")},
                  **({f"expert_{k}": m for k, m in layout.expert_meshes().items() if m.ndim == 1}
                     if plan.ep > 1 else {})}
        for dim, mesh in meshes.items():
            group = mesh.get_group()
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=group)
            seen[(label, dim)] = {"name": group.group_name, "ranks": dist.get_process_group_ranks(group),
                                  "sum": total.item()}
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, {"seen": seen})
    return {"views": views, "plans": {label: plan.to_dict() for label, plan in plans.items()}}


def set_up_once() -> dict:
    """Three fits (our GPT at tp=2 and at the planner's own plan, a U-Net in unit form at pp=2), each set-up stage
    that finds facts about the model counted on every rank; every rank's counts and findings gathered."""
    import torch.distributed as dist
    from any_model_models import MODELS
    from any_model_scenarios import fit as fit_unit_form

    from lightning_autopar.planner import search
    from lightning_autopar.profile import analyze, units
    from lightning_autopar.runtime import planning

    counts: dict = {}

    def counted(owner, name):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)
        return real, call

    patched = [(owner, name, *counted(owner, name)) for owner, name in
               [(analyze, "analyze"), (units, "analyze_model"), (planning, "find_capabilities"), (search, "plan")]]
    for owner, name, _, call in patched:
        setattr(owner, name, call)
    views: dict = {}
    try:
        for label, run_fit in [("gpt_tp2", lambda: fit("tp=2,dp=2", steps=2)), ("gpt_auto", lambda: fit(None, steps=2)),
                               ("unet_pp2", lambda: fit_unit_form("pp=2,dp=2,grad_accum=2", MODELS["unet"]))]:
            counts.clear()
            trainer = run_fit()[0]
            caps = trainer.strategy.capabilities
            found = {"counts": dict(counts), "analysis": trainer.strategy.analysis, "plan": trainer.strategy.plan,
                     "restrict": dict(caps.allowed), "excluded": dict(caps.excluded),
                     "facts": (caps.causal, dict(caps.unpaddable), caps.moe, caps.vocab, list(caps.unused))}
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, found)
            views[label] = gathered
    finally:
        for owner, name, real, _ in patched:
            setattr(owner, name, real)
    return {"views": views}


def run(out: Path, name: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if name in FIXES:
        fix = FIXES[name].format(w=world, ga=GLOBAL_BATCH // world) if FIXES[name] else None
        trainer, module, losses, plan = fit(fix)
        record(out, name, losses=losses, state=full_state(module), plan=plan, nodes=trainer.num_nodes,
               groups=trainer.strategy.mesh_layout.groups())
    elif name == "clip":
        trainer, module, losses, plan = fit("tp=2,dp=2,zero=3", gradient_clip_val=0.05)
        record(out, name, losses=losses, state=full_state(module), plan=plan)
    elif name == "resume":
        # save at step 4 during an 8-step run, then a fresh process state resumes from it (other init seed)
        saver = L.callbacks.ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=STEPS // 2, save_top_k=-1)
        fit("tp=2,dp=2,zero=3", enable_checkpointing=True, extra_callbacks=[saver])
        ckpt = out / "ckpts" / f"epoch=0-step={STEPS // 2}.ckpt"
        trainer, module, losses, plan = fit("tp=2,dp=2,zero=3", ckpt_path=str(ckpt), seed=123)
        record(out, name, losses=losses, state=full_state(module), plan=plan)
    elif name == "broadcast":
        record(out, name, **broadcast_states())
    elif name == "mesh_groups":
        record(out, name, **mesh_groups())
    elif name == "set_up_once":
        record(out, name, **set_up_once())
    elif name == "tp_indivisible":
        record_error(out, name, f"tp={world},dp=1", model_kwargs={"hidden": 48, "heads": 3})
    else:
        raise SystemExit(f"unknown scenario {name}")


def main(run_one=None) -> None:
    """Run the scenarios named in argv with ``run_one(out, name)`` (default: this file's ``run``)."""
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in settled(sys.argv[2].split(",")):
        try:
            (run_one or run)(out, name)
        except Exception:
            record(out, name, crash=traceback.format_exc())
            raise


if __name__ == "__main__":
    main(run)
