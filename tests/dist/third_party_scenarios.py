"""The third-party model matrix (issue 12), run under torchrun at world 4: every model of third_party_models.py
at every plan column, one process group for all cells.

Usage: torchrun --nproc-per-node 4 tests/dist/third_party_scenarios.py OUT_DIR cell[,cell...]  (or in the suite's batch)
A cell is ``f"{model}__{plan}"``. Rank 0 writes OUT_DIR/<cell>.started before it and OUT_DIR/<cell>.pt after it:
the per-step losses, the full state under the single-device names (gathered over stages and expert ranks), the
plan and the plan report's ``excluded`` reasons; or the one-line error it was refused with; or, when it crashed,
the first line of each rank's exception and rank 0's traceback. A crash does not stop the launch: every rank
reports its outcome to the others after each cell (so all ranks are at the same point) and the next cell runs.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp_scenarios import gathered_state  # noqa: E402  (merges pipeline stages and expert ranks)
from scenarios import fit, record  # noqa: E402
from third_party_models import MODELS, cell_dtype  # noqa: E402

import torch.distributed as dist  # noqa: E402

from lightning_autopar import AutoparError  # noqa: E402

STEPS = 4  # fewer than the other suites' 8 (which cross an epoch): about 100 cells have to fit the CI budget
# plan column -> the fields it pins (None: the planner's own plan); ep2 only for models with MoE layers
PLANS: dict[str, str | None] = {
    "auto": None,
    "zero3": "dp=4,zero=3",
    "tp2": "tp=2,dp=2",
    "ep2": "ep=2,dp=4",
    "pp2": "pp=2,dp=2",
    "ga2": "dp=4,zero=0,grad_accum=2",  # two micro-batches per step (a balance loss: the reference runs them too)
}
PLAN_FIELD = {"zero3": "zero", "tp2": "tp", "ep2": "ep", "pp2": "pp", "ga2": "grad_accum"}  # a column's field


def cells() -> list[str]:
    return [f"{model}__{plan}" for model, info in MODELS.items() for plan in PLANS
            if (plan != "ep2" or info.moe) and plan not in info.not_run]


def first_line(err: BaseException) -> str:
    """The exception as one line: its type and the first line of its message."""
    text = traceback.format_exception_only(type(err), err)[-1].strip()
    return text.splitlines()[0] if text else type(err).__name__


def attempt(cell: str) -> tuple[str, dict]:
    """Train one cell on this rank. Returns (kind, payload): kind "ok", "refused" (an AutoparError: the one line
    the user would see) or "crash" (anything else)."""
    model, plan = cell.split("__")
    started = time.perf_counter()
    try:
        with cell_dtype(model, plan):
            trainer, module, losses, plan_dict = fit(PLANS[plan], steps=STEPS, make=MODELS[model].make)
        state = gathered_state(module)
    except AutoparError as err:
        return "refused", {"error": str(err), "kind": type(err).__name__}
    except Exception as err:  # noqa: BLE001  (recorded as the cell's failure; the launch goes on)
        return "crash", {"crash": traceback.format_exc(), "first_line": first_line(err)}
    excluded = dict(getattr(trainer.strategy.report, "excluded", {}) or {})
    return "ok", {"losses": losses, "state": state, "plan": plan_dict, "excluded": excluded,
                  "seconds": time.perf_counter() - started}


def run_cell(out: Path, cell: str) -> None:
    rank = dist.get_rank()
    if rank == 0:
        (out / f"{cell}.started").touch()
    kind, payload = attempt(cell)
    outcomes: list = [None] * dist.get_world_size()
    summary = payload.get("first_line") or payload.get("error") or ""
    dist.all_gather_object(outcomes, (kind, summary))
    kinds = {k for k, _ in outcomes}
    if kinds == {kind} and kind != "crash":
        record(out, cell, **payload)
        return
    # a crash on any rank, or ranks that disagree: the cell failed; keep every rank's first line
    lines = [f"rank {r}: {k}: {s}" for r, (k, s) in enumerate(outcomes) if k != "ok"]
    first = next((s for k, s in outcomes if k == "crash"), None) or lines[0]
    record(out, cell, crash=payload.get("crash", ""), first_line=first, ranks=lines)


def run(out: Path, cell: str) -> None:
    """One cell on the live group (the first cell of a launch starts it: run_cell's ranks need it before the
    first Trainer, which then reuses it)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    run_cell(out, cell)


if __name__ == "__main__":
    from scenarios import main

    main(run)
