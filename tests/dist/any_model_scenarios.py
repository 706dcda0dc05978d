"""Models that are not transformers under ``strategy="autopar"`` at world 4 (issue 13): every cell of
tests/test_any_model.py in one process group.

Usage: torchrun --nproc-per-node 4 tests/dist/any_model_scenarios.py OUT_DIR cell[,cell...]
A cell is ``f"{model}__{plan}"`` (any_model_models.MODELS x PLANS). Rank 0 writes OUT_DIR/<cell>.pt: the per-step
losses, the full state (parameters and buffers, single-device names), the plan, the plan report's ``excluded``
reasons and the warnings autopar gave; or the one-line error the cell was refused with; or, when it crashed, the
traceback. A refused cell does not stop the launch; a crashed one ends it (tests/conftest.py relaunches the
cells not run).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from any_model_models import GLOBAL_BATCH, MODELS, STEPS, VisionCase  # noqa: E402
from pp_scenarios import gathered_state  # noqa: E402
from scenarios import LossCollector, record  # noqa: E402

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_autopar import AutoParallelStrategy, AutoparError  # noqa: E402

# plan column -> the fields it pins (None: the planner's own plan)
PLANS: dict[str, str | None] = {
    "auto": None,
    "zero3": "dp=4,zero=3",
    "accum": "dp=4,zero=0,grad_accum=2",  # BatchNorm: the user fixed it -> one warning, per-micro-batch statistics
    "recompute": "dp=4,zero=2,recompute=full",
}
# more cells; cnn__fabric: the same CNN in a plain Fabric loop at the planner's own plan
# unet__pp2*: pipeline stages traced from the U-Net's call, its skip connection crossing the split; cnn__pp2:
# refused (BatchNorm would normalise each micro-batch apart)
EXTRA = {"cnn__zero1": "dp=4,zero=1", "cnn__hsdp": "dp=4,zero=3,dp_shard=2", "cnn__tp2": "tp=2,dp=2",
         "resnet__selective": "dp=4,zero=3,recompute=selective", "cnn__fabric": None,
         "unet__pp2": "pp=2,dp=2,grad_accum=2", "unet__pp2z3": "pp=2,dp=2,zero=3,grad_accum=2", "unet__pp2rc": "pp=2,dp=2,grad_accum=2,recompute=full",
         "cnn__pp2": "pp=2,dp=2"}


def cells() -> list[str]:
    return [f"{m}__{p}" for m in MODELS for p in PLANS] + list(EXTRA) + ["batchnorm__uneven"]


def fix_of(cell: str) -> str | None:
    model, column = cell.split("__")
    return EXTRA[cell] if cell in EXTRA else PLANS[column]


def fit(fix: str | None, case: VisionCase):
    """Train ``case`` for STEPS steps under autopar with ``fix``: (trainer, module, logged losses, plan dict)."""
    L.seed_everything(0, verbose=False)
    module = case.make()
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=False, callbacks=[collector])
    trainer.fit(module, DataLoader(case.data(), batch_size=GLOBAL_BATCH, shuffle=False))
    return trainer, module, collector.losses, strategy.plan.to_dict()


def fabric_fit(fix: str | None, case: VisionCase):
    """The single-process loop written for Fabric (loader set up first: a model in unit form is traced on its
    first batch): (strategy, module, losses, plan dict)."""
    import torch
    from lightning.fabric import Fabric

    from lightning_autopar.fabric import AutoParallelFabricStrategy

    strategy = AutoParallelFabricStrategy(fix=fix, cluster="cpu", print_plan=False)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    L.seed_everything(0, verbose=False)
    module = case.make()
    optimizer = module.configure_optimizers()
    loader = fabric.setup_dataloaders(DataLoader(case.data(), batch_size=GLOBAL_BATCH, shuffle=False))
    model, optimizer = fabric.setup(module.model, optimizer)
    losses: list[float] = []
    while len(losses) < STEPS:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(module.call(model, x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if len(losses) == STEPS:
                break
    return strategy, module, losses, strategy.plan.to_dict()


def batchnorm_uneven(steps: int = 3) -> dict:
    """``parallel.batchnorm`` alone, hand-driven: ranks hold 2, 2, 2 and 1 rows of a 7-row batch (count-weighted
    statistics), BatchNorm with momentum 0.1 and None (cumulative average); gradients summed by hand. Returns the
    largest differences to one device running the 7 rows (state incl. running buffers, and the outputs); and
    ("residual 1x1") a residual branch and shortcut, each ending in a BatchNorm, summed on a 1x1 map with one row
    per rank, two micro-batches accumulated per step (the bias gradients were one shared tensor there)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_autopar.parallel.batchnorm import sync_batchnorm

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [2] * (world - 1) + [1]
    start = sum(sizes[:rank])
    diffs: dict[str, float] = {}
    torch.manual_seed(0)
    for momentum in (0.1, None):
        ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 6 * 6, 2))
        synced = copy.deepcopy(ref)
        sync_batchnorm(synced, dist.group.WORLD)
        x, y = torch.randn(sum(sizes), 3, 8, 8), torch.randn(sum(sizes), 2)
        out_diff = 0.0
        for _ in range(steps):
            want = ref(x)
            ((want - y) ** 2).sum().div(len(x)).backward()
            got = synced(x[start:start + sizes[rank]])
            ((got - y[start:start + sizes[rank]]) ** 2).sum().div(len(x)).backward()
            out_diff = max(out_diff, (got - want[start:start + sizes[rank]]).abs().max().item())
            _sgd_step(ref, synced)
        mine, theirs = synced.state_dict(), ref.state_dict()
        assert list(mine) == list(theirs), (list(mine), list(theirs))
        diffs[f"momentum={momentum}"] = max([(mine[k].double() - theirs[k].double()).abs().max().item()
                                             for k in theirs] + [out_diff])
    diffs["residual 1x1"] = _residual_one_by_one(steps)
    return diffs


def _sgd_step(ref, synced) -> None:
    """One SGD step (lr 0.1) of the one-device model and of this rank's copy, whose gradients are summed over the
    ranks by hand (each rank's loss already divided by the whole batch)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for a, b in zip(ref.parameters(), synced.parameters()):
            dist.all_reduce(b.grad)
            a -= 0.1 * a.grad
            b -= 0.1 * b.grad
            a.grad = b.grad = None


def _residual_one_by_one(steps: int) -> float:
    """The largest parameter difference to one device after ``steps`` steps of two accumulated micro-batches of
    one row per rank (``world`` rows each) through ``relu(bn(conv(x)) + bn(shortcut(x)))`` on a 1x1 map."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_autopar.parallel.batchnorm import sync_batchnorm

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.branch = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4))
            self.shortcut = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4))
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.branch(x)
            y += self.shortcut(x)  # in place, as Hugging Face's ResNet adds its shortcut
            return self.head(torch.relu(y).flatten(1))

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    ref = Residual()
    synced = copy.deepcopy(ref)
    sync_batchnorm(synced, dist.group.WORLD)
    for _ in range(steps):
        for _ in range(2):
            x, y = torch.randn(world, 3, 1, 1), torch.randn(world, 2)
            ((ref(x) - y) ** 2).mean().div(2).backward()
            ((synced(x[rank:rank + 1]) - y[rank:rank + 1]) ** 2).mean().div(2 * world).backward()
        _sgd_step(ref, synced)
    mine, theirs = synced.state_dict(), ref.state_dict()
    return max((mine[k].double() - theirs[k].double()).abs().max().item() for k in theirs)


def run(out: Path, cell: str) -> None:
    if cell == "batchnorm__uneven":
        import torch.distributed as dist

        if not dist.is_initialized():  # the first scenario of a launch: no Trainer has started the group yet
            dist.init_process_group("gloo")
        record(out, cell, diffs=batchnorm_uneven())
        return
    model, column = cell.split("__")
    case = MODELS[model]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if column == "fabric":
                strategy, module, losses, plan = fabric_fit(fix_of(cell), case)
            else:
                trainer, module, losses, plan = fit(fix_of(cell), case)
                strategy = trainer.strategy
        except AutoparError as err:
            record(out, cell, error=str(err))
            return
    said = [str(w.message) for w in caught if str(w.message).startswith("autopar")]
    record(out, cell, losses=losses, state=gathered_state(module), plan=plan, warnings=said,
           excluded=dict(strategy.report.excluded))


if __name__ == "__main__":
    from scenarios import main

    main(run)
