"""The runtime's fixed-cost terms (cost.py, hand cases) and the calibration fits (planner/calibrate.py): each fit
recovers the figures that generated its samples, and the refit matches measured steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_autopar.planner import calibrate as K
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate
from lightning_autopar.specs import (
    BlockSample,
    CollectiveSample,
    PeakTflops,
    Plan,
    RuntimeCosts,
    RuntimeProfile,
    load_cluster_spec,
    load_model_spec,
)


def _cluster(**runtime: float):
    c = load_cluster_spec("cpu", devices_per_node=4)
    return dataclasses.replace(c, runtime=RuntimeCosts(**runtime))


def _hw(**runtime: float) -> C.Hardware:
    return C.Hardware.from_cluster(_cluster(**runtime))


# ============================================================================================ cost terms


def test_step_and_microbatch_terms() -> None:
    hw = _hw(step_us=2000, microbatch_us=500)
    assert C.step_overhead_time(hw) == pytest.approx(2e-3)
    assert C.microbatch_overhead_time(hw, 4) == pytest.approx(4 * 5e-4)


def test_fsdp_unit_term_counts_collectives_per_zero() -> None:
    hw = _hw(fsdp_unit_us=100)
    # zero 3: 2 gathers per micro-batch + 1 reduction per step; 5 units, 4 micro-batches -> 5 * 9 calls
    assert C.fsdp_unit_overhead_time(hw, 5, 4, 3, True) == pytest.approx(5 * 9 * 1e-4)
    # zero 1/2: the parameters stay gathered across the step's micro-batches: 1 gather + 1 reduction per step
    assert C.fsdp_unit_overhead_time(hw, 5, 4, 2, True) == pytest.approx(5 * 2 * 1e-4)
    # zero 0 on FSDP2 (with tp/pp): the reduction only; plain DDP: nothing
    assert C.fsdp_unit_overhead_time(hw, 5, 4, 0, True) == pytest.approx(5 * 1e-4)
    assert C.fsdp_unit_overhead_time(hw, 5, 4, 0, False) == 0.0
    # zero 3 in a pipeline stage: gathered after each backward until the step's last (torch pipelining), so one
    # gather per micro-batch (backward) + the first forward's + the reduction
    assert C.fsdp_unit_overhead_time(hw, 5, 4, 3, True, pp=2) == pytest.approx(5 * 6 * 1e-4)


def test_tp_pipeline_ep_terms_only_when_used() -> None:
    hw = _hw(tp_block_us=50, pipeline_action_us=200, ep_layer_us=30)
    assert C.tp_dispatch_time(hw, 4, 3, 2) == pytest.approx(4 * 3 * 5e-5)
    assert C.tp_dispatch_time(hw, 4, 3, 1) == 0.0
    # interleaved x2: a forward and a backward action per chunk and slot
    assert C.pipeline_action_time(hw, 5, 2, 2) == pytest.approx(2 * 2 * 5 * 2e-4)
    assert C.pipeline_action_time(hw, 5, 1, 1) == 0.0
    assert C.ep_dispatch_time(hw, 2, 4, 2) == pytest.approx(2 * 4 * 3e-5)
    assert C.ep_dispatch_time(hw, 2, 4, 1) == 0.0


def test_collective_calls_and_sync_term() -> None:
    """Blocking collectives per step: FSDP2 units (zero 3: 2 gathers per micro-batch + 1 reduction), DDP buckets,
    4 TP all-reduces per block and micro-batch, a p2p per pipeline action, 4 all-to-alls per MoE layer and slot."""
    assert C.collective_calls(4, 3, True, 5, 4, 0, 1, 1, 1, 1, 4, 1e6) == pytest.approx(5 * 9)
    assert C.collective_calls(1, 0, False, 5, 4, 0, 1, 1, 1, 1, 4, 60e6) == pytest.approx(3)  # 60 MB / 25 MB
    assert C.collective_calls(1, 0, False, 5, 4, 0, 1, 1, 1, 1, 1, 60e6) == 0.0  # one rank: nothing to sync
    assert C.collective_calls(2, 0, True, 3, 2, 0, 2, 1, 1, 1, 2, 1e6) == pytest.approx(3 + 4 * 2 * 2)
    assert C.collective_calls(5, 0, True, 3, 2, 0, 1, 2, 2, 1, 2, 1e6) == pytest.approx(3 + 2 * 2 * 5)
    assert C.collective_calls(2, 0, True, 3, 2, 2, 1, 1, 1, 2, 2, 1e6) == pytest.approx(3 + 4 * 2 * 2)
    assert C.collective_sync_time(_hw(sync_us=400), 10) == pytest.approx(4e-3)


def test_runtime_terms_add_to_the_step_and_name_themselves() -> None:
    fix = "dp=4,zero=3,mbs=1"
    layers = load_model_spec("gpt_small").layers
    bare = estimate("gpt_small", _cluster(), fix, global_batch=16, seq_len=128)
    # nothing measured: only FSDP2's per-unit ops, at the CPU device's per-op cost (cost.fsdp_unit_seconds)
    per_unit_call = C.FSDP2_OPS_PER_UNIT_CALL * 8e-6  # configs/cluster/cpu.yaml kernel_overhead_us
    assert {k: v for k, v in bare.breakdown.terms.items() if v} == {
        "fsdp_units": pytest.approx((layers + 1) * (4 * 2 + 1) * per_unit_call)}
    gpu = load_cluster_spec("h100-sxm-dgx")
    assert estimate("gpt_small", gpu, "dp=8,zero=3,mbs=1", global_batch=16, seq_len=128).breakdown.terms == {}
    priced = estimate("gpt_small", _cluster(step_us=1e4, microbatch_us=1e3, fsdp_unit_us=500), fix,
                      global_batch=16, seq_len=128)
    terms = priced.breakdown.terms
    assert set(terms) == set(C.RUNTIME_TERMS)
    assert terms["step"] == pytest.approx(1e-2)
    assert terms["microbatch"] == pytest.approx(4 * 1e-3)
    assert terms["fsdp_units"] == pytest.approx((layers + 1) * (4 * 2 + 1) * 5e-4)
    assert priced.breakdown.runtime_s == pytest.approx(sum(terms.values()))
    assert priced.step_time_s == pytest.approx(bare.step_time_s - bare.breakdown.runtime_s + priced.breakdown.runtime_s)
    assert "runtime_terms_s" in priced.to_dict() and "runtime_s" not in priced.to_dict()["breakdown"]


def test_zero1_and_zero2_price_alike() -> None:
    """The runtime applies zero 1 and 2 alike (one gather and one reduction per step): so does the model."""
    c = _cluster()
    one = estimate("gpt_small", c, "dp=4,zero=1,mbs=1", global_batch=16, seq_len=128)
    two = estimate("gpt_small", c, "dp=4,zero=2,mbs=1", global_batch=16, seq_len=128)
    assert one.step_time_s == pytest.approx(two.step_time_s)


# ============================================================================================ fits


def _truth():
    c = load_cluster_spec("cpu", devices_per_node=4)
    dev = dataclasses.replace(c.device, peak_tflops=PeakTflops(bf16=0.2, fp16=0.03, fp32=0.04),
                              memory_bandwidth_gbs=5.0, kernel_overhead_us=30.0)
    link = dataclasses.replace(c.links[0], latency_us=300.0, bandwidth_gbs=0.3)
    return dataclasses.replace(c, device=dev, links=[link])


def _samples(truth, model):
    hw = C.Hardware.from_cluster(truth)
    blocks = []
    for mbs in (1, 4):
        for kind in ("dense", "embedding", "head"):
            s = BlockSample(kind, mbs, 128, "fp32", 0.0, 0.0)
            f, b = K._block_times(hw, model, s)
            blocks.append(dataclasses.replace(s, fwd_s=f, bwd_s=b))
    colls = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        for n, stride in ((4, 1), (2, 1), (2, 2)):
            for nbytes in (4096, 4 << 20):
                s = CollectiveSample(op, 2 if op == "p2p" else n, stride, nbytes, 0.0)
                colls.append(dataclasses.replace(s, seconds=K._collective_time(hw, s)))
    return blocks, colls


def test_fit_device_and_links_recover_the_figures() -> None:
    model = load_model_spec("gpt_small")
    truth = _truth()
    blocks, colls = _samples(truth, model)
    start = load_cluster_spec("cpu", devices_per_node=4)
    dev_fit, err = K.fit_device(start, model, blocks)
    assert err < 1e-6
    assert dev_fit.device.peak_tflops.fp32 == pytest.approx(0.04, rel=1e-3)
    assert dev_fit.device.memory_bandwidth_gbs == pytest.approx(5.0, rel=1e-3)
    assert dev_fit.device.kernel_overhead_us == pytest.approx(30.0, rel=1e-3)
    link_fit, err = K.fit_links(start, colls)
    assert err < 0.01
    assert link_fit.links[0].latency_us == pytest.approx(300.0, rel=0.01)
    assert link_fit.links[0].bandwidth_gbs == pytest.approx(0.3, rel=0.01)


def test_reduce_scatter_factor_is_measured_and_priced() -> None:
    """A backend whose reduce-scatter takes twice an all-gather (gloo here): the fit finds the factor, the
    cost model prices reduce-scatters with it, and the link figures stay those of the other ops."""
    model = load_model_spec("gpt_small")
    truth = _truth()
    truth = dataclasses.replace(truth, links=[dataclasses.replace(truth.links[0], reduce_scatter_factor=2.0)])
    hw = C.Hardware.from_cluster(truth)
    assert C.reduce_scatter_time(hw, 4e6, 4, 1) == pytest.approx(2 * C.allgather_time(hw, 4e6, 4, 1))
    _, colls = _samples(truth, model)
    assert K.reduce_scatter_factor(colls) == pytest.approx(2.0)
    fit, err = K.fit_links(load_cluster_spec("cpu", devices_per_node=4), colls)
    assert err < 0.01 and fit.links[0].reduce_scatter_factor == pytest.approx(2.0)
    assert fit.links[0].latency_us == pytest.approx(300.0, rel=0.01)
    z3 = "dp=4,zero=3,mbs=4"  # its gradients are reduce-scattered: dearer on the truth than with factor 1
    assert (estimate(model, truth, z3, global_batch=16, seq_len=128).step_time_s
            > estimate(model, _truth(), z3, global_batch=16, seq_len=128).step_time_s)


def test_calibrated_cluster_predicts_the_truth_and_round_trips() -> None:
    model = load_model_spec("gpt_small")
    truth = _truth()
    blocks, colls = _samples(truth, model)
    cal = K.calibrate(load_cluster_spec("cpu", devices_per_node=4), model,
                      RuntimeProfile(blocks=blocks, collectives=colls))
    assert cal.name.endswith("-calibrated") and cal.runtime.source == "profile"
    for fix in ("dp=4,zero=3,mbs=1", "dp=4,zero=0,mbs=4", "dp=2,pp=2,mbs=2"):
        want = estimate(model, truth, fix, global_batch=16, seq_len=128).step_time_s
        assert estimate(model, cal, fix, global_batch=16, seq_len=128).step_time_s == pytest.approx(want, rel=0.01)
    # the YAML the cache and `autopar probe` write loads back to the same prediction
    from lightning_autopar.runtime.probe import spec_yaml
    import yaml

    again = load_cluster_spec(yaml.safe_load(spec_yaml(cal)))
    fix = "dp=4,zero=3,mbs=1"
    assert (estimate(model, again, fix, global_batch=16, seq_len=128).step_time_s
            == pytest.approx(estimate(model, cal, fix, global_batch=16, seq_len=128).step_time_s, rel=1e-4))


def test_refit_matches_measured_steps() -> None:
    model = load_model_spec("gpt_small")
    cal = _cluster(fsdp_unit_us=200)
    obs = [(Plan(dp=4, zero=3, mbs=1, grad_accum=4), 0.9), (Plan(dp=4, zero=3, mbs=4, grad_accum=1), 0.5)]
    fit = K.refit(cal, model, obs, 16, 128)
    for p, measured in obs:
        assert estimate(model, fit, p, global_batch=16, seq_len=128).step_time_s == pytest.approx(measured, rel=0.01)
    assert "refit on 2 measured plans" in fit.runtime.source
    # one step: the prediction moves most of the way, the figures stay physical (>= 0)
    one = K.refit(cal, model, obs[:1], 16, 128)
    got = estimate(model, one, obs[0][0], global_batch=16, seq_len=128).step_time_s
    assert got == pytest.approx(0.9, rel=0.05)
    assert one.runtime.step_us >= 0 and one.runtime.microbatch_us >= 0
    assert K.refit(cal, model, [], 16, 128) is cal


def test_nnls_and_describe() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert np.allclose(K.nnls(a, np.array([2.0, -1.0])), [2.0, 0.0])
    lines = K.describe(_cluster(fsdp_unit_us=120, step_us=900))
    assert lines[0].startswith("device cpu") and any("fsdp_unit 120 us" in line for line in lines)
