"""Per-block torch.compile (plan.compile, parallel/compile.py) and its price (planner.cost.compiled_block_time).

Distributed (world 2, one torchrun): compile=true at dp (DDP zero 0, FSDP2 zero 3) and at tp=2 (also with full
recompute) equals the single-process eager loop within rtol 1e-4; a block that fails to compile warns once naming
it and trains eager, equal too. Planner: without a measured speed-up on a CPU cluster compile=true is never predicted faster than
eager (nor chosen), on an H100 preset it is faster by the fused element-wise traffic, and a measured speed-up
carried by the cluster (RuntimeCosts.compile_speedup, through calibrate) scales the blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import run_scenarios
from common import reference_run
from test_strategy import PARAM_ATOL, load

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.compile import check_compile
from lightning_autopar.planner.calibrate import merged_runtime, scaled
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.specs import RuntimeCosts, load_cluster_spec

COMPILE_RTOL = 1e-4
SCENARIOS = ["dp_zero0", "dp_zero3", "tp2", "tp2_full", "pp2", "fails"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, SCENARIOS, script="compile_scenarios.py")


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def assert_close_to(result, ref_losses, ref_state, stage=False):
    """``stage``: the result holds rank 0's pipeline stage only (its parameters, under the single-device names)."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=COMPILE_RTOL, atol=0)
    if stage:
        assert result["state"] and set(result["state"]) < set(ref_state)
        ref_state = {name: ref_state[name] for name in result["state"]}
    assert set(result["state"]) == set(ref_state), "parameter names stay those of the single-device module"
    for name, ref in ref_state.items():
        torch.testing.assert_close(result["state"][name], ref, rtol=COMPILE_RTOL, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("name, degrees", [("dp_zero0", (2, 1, 0)), ("dp_zero3", (2, 1, 3)), ("tp2", (1, 2, 0)),
                                           ("tp2_full", (1, 2, 0)), ("pp2", (1, 1, 0))])
def test_compiled_blocks_match_single_process(world2, reference, name, degrees):
    result = load(world2, name)
    assert result["plan"]["compile"] is True
    assert (result["plan"]["dp"], result["plan"]["tp"], result["plan"]["zero"]) == degrees
    assert result["warnings"] == [] and result["checks"] == {"Block": True}  # every block compiled
    assert_close_to(result, *reference, stage=name == "pp2")


def test_block_that_fails_to_compile_warns_once_and_trains_eager(world2, reference):
    result = load(world2, "fails")
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert "'blocks.0'" in warning and "FailingBlock" in warning and "runs eager" in warning
    assert "no kernel for compiled graphs" in warning and "\n" not in warning
    assert result["checks"] == {"FailingBlock": False}
    assert result["plan"]["compile"] is True  # what was asked; the warning says which blocks run eager
    assert_close_to(result, *reference)


def test_compile_refusals_are_one_line():
    for args, field in [((True, 2, "cpu", False, "zbv"), "plan.compile"), ((False, 1, "cpu", True), "async_tp")]:
        with pytest.raises(ConfigError) as err:
            check_compile(*args)
        assert str(err.value).startswith(field) and "\n" not in str(err.value)
    check_compile(True, 1, "cpu")
    check_compile(True, 2, "cpu", schedule="1f1b")  # one backward per stage: compiled blocks run in the stages
    check_compile(False, 1, "cuda", True)


# ------------------------------------------------------------------------------------------- planner

def step(cluster, fix, model="llama_tiny", batch=8):
    return estimate(model, cluster, fix, global_batch=batch).step_time_s


def test_compile_not_priced_faster_on_cpu_without_measurement():
    cpu = load_cluster_spec("cpu")
    assert not cpu.device.compile_fuses and cpu.runtime.compile_speedup == 0
    for model in ("llama_tiny", "gpt-tiny"):
        assert step(cpu, "dp=2,compile=true", model) >= step(cpu, "dp=2", model)
    best = plan("llama_tiny", cpu, global_batch=8, top=3).best.plan
    assert best.compile is False  # a tie goes to eager: compile=true is not chosen blindly


def test_compile_priced_faster_on_h100_by_fused_traffic():
    h100 = load_cluster_spec("h100-sxm-dgx")
    h100 = dataclasses.replace(h100, device=dataclasses.replace(h100.device, compile_fuses=True))
    eager, compiled = step(h100, "tp=8,dp=1", "llama3-8b"), step(h100, "tp=8,dp=1,compile=true", "llama3-8b")
    assert compiled < eager
    # without the fusing flag (a device inductor does not fuse on) the same plan is not faster
    plain = dataclasses.replace(h100, device=dataclasses.replace(h100.device, compile_fuses=False))
    assert step(plain, "tp=8,dp=1,compile=true", "llama3-8b") >= step(plain, "tp=8,dp=1", "llama3-8b")


def test_async_tp_hides_tp_collectives_with_compile_and_sp_on_gpu():
    h100 = load_cluster_spec("h100-sxm-dgx")
    h100 = dataclasses.replace(h100, device=dataclasses.replace(h100.device, compile_fuses=True))
    est = lambda fix: estimate("llama3-8b", h100, fix, global_batch=8).breakdown  # noqa: E731
    assert est("tp=8,dp=1,sp=true,compile=true").comm_exposed_s < est("tp=8,dp=1,sp=true").comm_exposed_s


def test_measured_speedup_is_used_and_carried_by_calibration():
    cpu = load_cluster_spec("cpu")
    eager = step(cpu, "dp=2")
    measured = merged_runtime(cpu.runtime, RuntimeCosts(compile_speedup=2.0), "profile")
    assert measured.compile_speedup == 2.0
    fast = dataclasses.replace(cpu, runtime=measured)
    assert step(fast, "dp=2,compile=true") < eager
    assert step(fast, "dp=2") == pytest.approx(eager)
    assert scaled(fast, 2.0).runtime.compile_speedup == 2.0  # a ratio: unchanged on a slower machine
    slow = dataclasses.replace(cpu, runtime=RuntimeCosts(compile_speedup=0.5))  # compile measured slower
    assert step(slow, "dp=2,compile=true") > eager
