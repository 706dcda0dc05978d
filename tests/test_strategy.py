"""The contract: every plan kind trains exactly like the plain single-process loop.

Each scenario (tests/dist/scenarios.py) trains the same small GPT on the same data and seed for 8 SGD-with-
momentum steps under strategy="autopar" with a pinned (or planned) layout; per-step logged losses and final
parameters must equal the single-process reference (fp32) within LOSS_RTOL / PARAM_RTOL + PARAM_ATOL.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_scenarios
from common import STEPS, reference_run

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = 1e-6

WORLD4 = ["dp_zero0", "dp_zero3", "hsdp", "tp2_dp2_zero3", "tp2_dp2_accum", "auto", "clip", "resume"]
WORLD2 = ["tp", "dp_zero2", "dp_accum", "dp_zero2_accum", "tp_indivisible", "broadcast"]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, WORLD2)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def load(out, name):
    result = torch.load(out / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    return result


def assert_equivalent(result, ref_losses, ref_state, first_step=0):
    losses = result["losses"]
    assert len(losses) == STEPS - first_step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[first_step:]), rtol=LOSS_RTOL, atol=0)
    state = result["state"]
    assert set(state) == set(ref_state), "parameter names must stay those of the single-device module"
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("name", ["dp_zero0", "dp_zero3", "hsdp", "tp2_dp2_zero3", "tp2_dp2_accum", "auto"])
def test_world4_matches_single_process(world4, reference, name):
    assert_equivalent(load(world4, name), *reference)


@pytest.mark.parametrize("name", ["tp", "dp_zero2", "dp_accum", "dp_zero2_accum"])
def test_world2_matches_single_process(world2, reference, name):
    assert_equivalent(load(world2, name), *reference)


def test_plans_are_the_requested_ones(world4, world2):
    plan = load(world4, "dp_zero0")["plan"]
    assert (plan["dp"], plan["zero"], plan["tp"]) == (4, 0, 1)
    plan = load(world4, "tp2_dp2_accum")["plan"]
    assert (plan["tp"], plan["dp"], plan["zero"], plan["grad_accum"], plan["mbs"]) == (2, 2, 3, 2, 2)
    assert load(world4, "hsdp")["plan"]["dp_shard"] == 2
    assert load(world2, "dp_accum")["plan"]["grad_accum"] == 4
    assert (load(world2, "dp_zero2_accum")["plan"]["zero"], load(world2, "dp_zero2_accum")["plan"]["grad_accum"]) == (2, 4)
    auto = load(world4, "auto")["plan"]
    assert auto["dp"] * auto["tp"] * auto["pp"] * auto["cp"] == 4
    assert auto["dp"] * auto["mbs"] * auto["grad_accum"] == 8


def test_gradient_clipping_matches(world4):
    assert_equivalent(load(world4, "clip"), *reference_run(clip=0.05))


def test_resume_from_step4_continues_exactly(world4, reference):
    """Saved at step 4 (DCP, sharded), resumed from a differently initialised model: steps 5-8 are identical."""
    assert_equivalent(load(world4, "resume"), *reference, first_step=STEPS // 2)


def test_every_rank_starts_from_rank_0s_tensors(world2):
    """runtime.group.broadcast_module: buckets of one dtype (fp32, fp64, bool; a tied and a non-contiguous
    tensor), several per dtype at 64 and 40 bytes (the non-contiguous one alone) and one at the default size;
    each rank had other values before."""
    result = load(world2, "broadcast")
    for bucket in ("bucket_64", "bucket_40", "bucket_None"):
        case = result[bucket]
        assert case["tied"], "the tie survives"
        assert not torch.equal(case["differed"][0], case["differed"][1]), "the ranks started apart"
        assert set(case["after"]) == set(case["before"])
        for key, per_rank in case["after"].items():
            for value in per_rank:
                assert torch.equal(value, case["before"][key].to(torch.float64)), (bucket, key)


def test_forced_tp_not_dividing_heads_is_one_clear_error(world2):
    result = load(world2, "tp_indivisible")
    assert result["kind"] == "ConfigError"
    assert result["error"].startswith("plan.tp: tp=2 does not divide heads=3")
    assert "\n" not in result["error"]


SCRIPT = """
import lightning.pytorch as L, lightning_autopar, sys
sys.path.insert(0, 'tests/dist')
from common import make_module, make_data
from torch.utils.data import DataLoader
strategy = lightning_autopar.AutoParallelStrategy(fix=sys.argv[1], cluster='cpu')
trainer = L.Trainer(strategy=strategy, accelerator='cpu', devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(make_module(hidden=48, heads=3), DataLoader(make_data(), batch_size=8))
"""


@pytest.mark.parametrize("fix, env, expected", [
    ("tp=two", {}, "autopar: fix.tp: expected an integer, got 'two'"),
    ("tq=2", {}, "autopar: fix.tq: unknown plan field"),
    ("tp=2", {}, "autopar: plan.tp: tp=2 does not divide heads=3"),
    ("dp=1", {"AUTOPAR_PG_TIMEOUT": "soon"}, "autopar: AUTOPAR_PG_TIMEOUT: 'soon' is not a number of seconds; fix:"),
])
def test_bad_fix_exits_2_with_one_line(fix, env, expected):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, fix], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("autopar")]
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-3000:]


def test_plain_data_parallel_runs_on_ddp():
    """zero=0 with data parallelism alone goes to DDP (replicate: bucketed all-reduce); composed with another
    parallelism, or on an MoE model, zero=0 stays on FSDP2's replicate mesh."""
    from common import model_config

    from lightning_autopar.models.gpt import GPT
    from lightning_autopar.parallel.apply import plain_ddp
    from lightning_autopar.profile.analyze import analyze
    from lightning_autopar.specs import Plan

    dense = analyze(GPT(model_config()), trace=False)
    moe = analyze(GPT(model_config(experts=4, top_k=2)), trace=False)
    assert plain_ddp(Plan(dp=4, zero=0), dense)
    assert not plain_ddp(Plan(dp=4, zero=0), moe)
    assert not plain_ddp(Plan(dp=4, zero=3), dense)
    assert not plain_ddp(Plan(dp=2, tp=2, zero=0), dense)
    assert not plain_ddp(Plan(dp=2, pp=2, zero=0), dense)
    assert not plain_ddp(Plan(dp=1, zero=0), dense)
