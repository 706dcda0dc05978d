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
from pp_scenarios import gathered_state  # noqa: E402
from scenarios import LossCollector, full_state, main, record  # noqa: E402

FABRIC_FIXES = {"fabric_dp": "dp={w},zero=3", "fabric_tp": "tp={w},dp=1", "fabric_ddp": "dp={w},zero=0"}


def fabric_run(fix: str | None, steps: int = STEPS, accumulate: int = 1, model_first: bool = False,
               batch_size: int = GLOBAL_BATCH, step_call: bool = False):
    """The reference loop of common.reference_run, written for Fabric with strategy autopar. ``accumulate``:
    each rank's rows in that many backward passes, all but the last under ``fabric.no_backward_sync`` (the
    first step checks that they really stayed local: ranks' gradients differ before the last backward).
    ``model_first``: Fabric's documented order, ``fabric.setup(model, optimizer)`` before
    ``fabric.setup_dataloaders`` (the plan's batch fields are settled by the loader)."""
    from lightning.fabric import Fabric

    from lightning_autopar.fabric import AutoParallelFabricStrategy
    from lightning_autopar.models import lm_loss

    world = int(os.environ["WORLD_SIZE"])
    devices = int(os.environ.get("LOCAL_WORLD_SIZE") or world)  # per node; `fabric run --num-nodes 2` gives 2 x 2
    strategy = AutoParallelFabricStrategy(fix=fix, cluster="cpu", print_plan=False, step_call=step_call)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=devices, num_nodes=world // devices)
    if not os.environ.get("LT_CLI_USED"):  # `fabric run` made the processes: Fabric refuses a second launch()
        fabric.launch()
    L.seed_everything(0, verbose=False)
    module = make_module()
    optimizer = module.configure_optimizers()
    data = DataLoader(make_data(), batch_size=batch_size, shuffle=False)
    if model_first:
        model, optimizer = fabric.setup(module, optimizer)
        loader = fabric.setup_dataloaders(data)
    else:
        loader = fabric.setup_dataloaders(data)
        model, optimizer = fabric.setup(module, optimizer)
    losses, local_grads_differ = [], None
    while len(losses) < steps:
        for x, y in loader:
            if step_call:  # the global batch: model.train_step runs the plan's micro-batches (pp: the schedule)
                loss = model.train_step((x, y), lambda micro: lm_loss(model(micro[0]), micro[1]))
                optimizer.step()
                optimizer.zero_grad()
                losses.append(fabric.all_reduce(loss, reduce_op="mean").item())
                if len(losses) == steps:
                    break
                continue
            assert x.shape[0] == GLOBAL_BATCH // strategy.plan.dp, x.shape  # this rank's slice
            parts = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
            loss = 0.0
            for i, (xs, ys) in enumerate(parts):
                last = i == len(parts) - 1
                if last and accumulate > 1 and local_grads_differ is None:
                    norm = next(p for p in module.parameters() if p.grad is not None).grad.norm().reshape(1)
                    local_grads_differ = len(set(fabric.all_gather(norm).flatten().tolist())) > 1
                with fabric.no_backward_sync(model, enabled=not last):
                    part = lm_loss(model(xs), ys) / accumulate
                    fabric.backward(part)
                loss = loss + part.detach()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if len(losses) == steps:
                break
    report = strategy.report
    assert report.best.plan == strategy.plan and report.global_batch == batch_size, (report.best, strategy.plan)
    return module, losses, strategy.plan.to_dict(), local_grads_differ


def fabric_checkpoint(fix: str, path: Path) -> tuple[list[float], list[float], dict]:
    """fabric.save after 2 steps, 2 more steps (the reference), fabric.load of the saved state and the same 2
    steps again: (reference losses, losses after the load, plan)."""
    from lightning.fabric import Fabric

    from lightning_autopar.fabric import AutoParallelFabricStrategy
    from lightning_autopar.models import lm_loss

    strategy = AutoParallelFabricStrategy(fix=fix, cluster="cpu", print_plan=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    L.seed_everything(0, verbose=False)
    module = make_module()
    optimizer = module.configure_optimizers()
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=GLOBAL_BATCH, shuffle=False))
    model, optimizer = fabric.setup(module, optimizer)

    def steps(batches) -> list[float]:
        out = []
        for x, y in batches:
            loss = lm_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        return out

    batches = list(loader)[:4]
    steps(batches[:2])
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    reference = steps(batches[2:])
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 2, state
    return reference, steps(batches[2:]), strategy.plan.to_dict()


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
        module, losses, plan, _ = fabric_run(FABRIC_FIXES[name].format(w=world))
    elif name == "fabric_ddp_accum":  # fabric.no_backward_sync on the DDP (replicate) path
        module, losses, plan, local_grads_differ = fabric_run(f"dp={world},zero=0", accumulate=2)
        record(out, name, losses=losses, state=full_state(module), plan=plan, local_grads_differ=local_grads_differ)
        return
    elif name == "fabric_step_pp2":  # model.train_step(batch, loss_fn): the pipeline's schedule in Fabric's loop
        module, losses, plan, _ = fabric_run(f"pp=2,dp={world // 2},grad_accum=2", step_call=True)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
        return
    elif name == "fabric_model_first":  # Fabric's documented order, the layout left to the planner
        module, losses, plan, _ = fabric_run(None, model_first=True)
    elif name == "fabric_model_first_refused":  # a batch the layout planned at fabric.setup cannot split evenly
        from lightning_autopar.errors import ConfigError

        try:
            fabric_run(f"dp={world}", steps=1, model_first=True, batch_size=GLOBAL_BATCH - 1)
        except ConfigError as err:
            record(out, name, error=str(err), field=err.field)
            return
        raise AssertionError("an indivisible global batch was accepted")
    elif name.startswith("fabric_checkpoint_zero"):  # fabric.save / fabric.load at zero=0 (DDP) and zero=3
        reference, resumed, plan = fabric_checkpoint(f"dp={world},zero={name[-1]}", out / f"{name}_ckpt")
        record(out, name, reference=reference, resumed=resumed, plan=plan)
        return
    elif name == "hf_llama":
        module, losses, plan = hf_fit(f"dp={world},zero=3")
    elif name == "hf_llama_tp":  # Hugging Face attention split by heads, the model unchanged
        module, losses, plan = hf_fit(f"tp={world},dp=1")
    else:
        raise SystemExit(f"unknown scenario {name}")
    record(out, name, losses=losses, state=full_state(module), plan=plan)


if __name__ == "__main__":
    main(run)
