"""Accelerate (issue 31): ``lightning_autopar.accelerate.prepare`` plans and applies autopar's own layout inside the
user's Accelerate loop (``Accelerator(cpu=True)`` under torchrun, MULTI_CPU on gloo), and the loop trains as the
single-process loop does (rtol 1e-5). At 4 processes (the issue's cells): the planner's own plan for a tiny HF
Llama, tp=2 x dp=2 with zero=3, a MoE GPT at ep=2 and pp=2 through the step call. At 2: DDP with
``accelerator.accumulate``, Accelerate's per-process batches, zero=3 micro-batches in the step call, and
``save_state`` at one plan resumed at another."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from common import GLOBAL_BATCH, STEPS, make_data, make_module
from conftest import run_scenarios
from test_strategy import assert_equivalent
from tests_hf import hf_reference_run

pytest.importorskip("accelerate", reason="extra 'accelerate' not installed")

CLIP = 0.05  # accelerate_scenarios.CLIP
WORLD4 = ["acc_auto_llama", "acc_tp2_zero3_accum_clip", "acc_moe_ep2", "acc_step_pp2"]
WORLD2 = ["acc_ddp_accum", "acc_zero3_per_process", "acc_resume_zero3_to_tp", "acc_step_zero3_accum",
          "acc_tp_per_process"]
MOE = (("experts", 4), ("top_k", 2))  # accelerate_scenarios.MOE


@lru_cache(maxsize=None)
def accelerate_reference(accumulate: int = 1, clip: float | None = None, model: tuple = (), steps: int = STEPS):
    """The Accelerate loop on one process: each loader batch (the global batch, unshuffled) one backward of its
    loss / ``accumulate``; every ``accumulate`` batches the gradients clipped to ``clip`` and one SGD step.
    ``model``: the GPT config's overrides, as (key, value) pairs. Returns (the loss of every batch, the final
    state dict)."""
    import lightning.pytorch as L

    from lightning_autopar.models import lm_loss

    L.seed_everything(0, verbose=False)
    module = make_module(**dict(model))
    opt = module.configure_optimizers()
    data = make_data()
    losses = []
    for b in range(steps):
        i = b % (len(data) // GLOBAL_BATCH)
        x, y = data[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
        loss = lm_loss(module(x), y)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (b + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, WORLD2, script="accelerate_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="accelerate_scenarios.py")


def load(out, name: str) -> dict:
    result = torch.load(out / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    return result


def check_loop_plan(plan: dict, layout: tuple | None) -> None:
    """A loop that calls backward: one micro-batch per backward, no pipeline, the global batch over dp."""
    assert plan["grad_accum"] == 1 and plan["pp"] == 1 and plan["dp"] * plan["mbs"] == GLOBAL_BATCH
    if layout is not None:
        assert (plan["dp"], plan["tp"], plan["zero"]) == layout


def test_accelerate_loop_at_the_planners_plan_for_an_hf_llama(world4):
    """The planner's own plan (4 processes) for a tiny HF Llama in the Accelerate loop."""
    result = load(world4, "acc_auto_llama")
    check_loop_plan(result["plan"], None)
    assert_equivalent(result, *hf_reference_run(STEPS))


@pytest.mark.parametrize("name, accumulate, clip, layout", [
    ("acc_tp2_zero3_accum_clip", 2, CLIP, (2, 2, 3)),  # tp=2 x dp=2, FSDP2, accelerator.accumulate, clipped
])
def test_accelerate_loop_at_world4_matches_single_process(world4, name, accumulate, clip, layout):
    result = load(world4, name)
    check_loop_plan(result["plan"], layout)
    assert_equivalent(result, *accelerate_reference(accumulate, clip))


@pytest.mark.parametrize("name, accumulate, clip, layout", [
    ("acc_ddp_accum", 2, None, (2, 1, 0)),
    ("acc_zero3_per_process", 1, None, (2, 1, 3)),  # no split_batches: each dp rank its own loader batch of 4
    ("acc_tp_per_process", 1, None, (1, 2, 0)),  # no split_batches at tp=2: both ranks one loader batch of 8
])
def test_accelerate_loop_at_world2_matches_single_process(world2, name, accumulate, clip, layout):
    result = load(world2, name)
    check_loop_plan(result["plan"], layout)
    assert_equivalent(result, *accelerate_reference(accumulate, clip))


def test_accelerate_save_state_resumes_at_another_plan(world2):
    """``accelerator.save_state`` after 4 batches at dp=2, zero=3; a new model prepared at tp=2 and
    ``accelerator.load_state`` continues as the uninterrupted single-process loop."""
    result = load(world2, "acc_resume_zero3_to_tp")
    assert (result["plan"]["tp"], result["plan"]["dp"]) == (2, 1)
    assert_equivalent(result, *accelerate_reference(), first_step=4)


@pytest.mark.parametrize("world, name, clip, layout", [
    (4, "acc_step_pp2", CLIP, (2, 2, 2)),  # the pipeline schedule (pp=2 x dp=2, 2 micro-batches), clipped
    (2, "acc_step_zero3_accum", None, (1, 2, 2)),  # FSDP2 with 2 micro-batches in one train_step
])
def test_accelerate_step_call_matches_single_process(request, world, name, clip, layout):
    """``prepare(..., step_call=True)``: the loop calls ``model.train_step(batch, loss_fn)`` on the global batch
    and ``optimizer.step()``; the plan's pp and grad_accum run inside the call."""
    result = load(request.getfixturevalue(f"world{world}"), name)
    plan = result["plan"]
    assert (plan["pp"], plan["dp"], plan["grad_accum"]) == layout
    assert_equivalent(result, *accelerate_reference(1, clip))


def test_accelerate_loop_with_expert_parallelism_matches_single_process(world4):
    """A MoE GPT (4 experts, top 2) prepared at dp=4, ep=2: each rank holds 2 experts (tokens exchanged by
    all-to-all) in Accelerate's loop, gradients clipped over every rank's experts."""
    result = load(world4, "acc_moe_ep2")
    assert (result["plan"]["dp"], result["plan"]["ep"]) == (4, 2)
    assert_equivalent(result, *accelerate_reference(1, CLIP, MOE))
