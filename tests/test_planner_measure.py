"""profile/measure.py on this CPU: device rates, per-block timings and saved activations fed to plan()."""

from __future__ import annotations

import pytest
import torch

from lightning_autopar.models import GPT, GPTConfig
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.profile.measure import measure_blocks, measure_device
from lightning_autopar.specs import Measured, ModelSpec, load_cluster_spec


def test_measure_device_small() -> None:
    cal = measure_device("cpu", precisions=("fp32",), sizes=(64, 128), copy_mib=8)
    assert cal.matmul_tflops["fp32"] > 0 and len(cal.curve) == 2
    assert cal.memory_bandwidth_gbs > 0 and cal.kernel_overhead_us > 0


def test_measure_blocks_feeds_the_planner() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, experts=4, top_k=2, moe_every=2)
    model = GPT(cfg)
    meas = measure_blocks(model, mbs=2, seq_len=64, precision="fp32", device="cpu", reps=2)
    assert set(meas.blocks) == {"dense", "moe", "embedding", "head"}
    for b in meas.blocks.values():
        assert b.fwd_s > 0 and b.bwd_s >= 0
    # the saved activations of a dense block, fused attention, no dropout stored: within 2x of Korthikanti's count
    spec = ModelSpec(name="t", layers=2, hidden=64, heads=4, vocab=256, seq_len=64, experts=4, top_k=2, moe_every=2)
    analytic = float(C.activation_bytes_per_block(spec, 2, 64, 1, False, 1, 0, 4.0, True))
    assert 0.5 * analytic < meas.blocks["dense"].activation_bytes < 2 * analytic
    cluster = load_cluster_spec("cpu")
    priced = estimate(spec, cluster, "dp=2,mbs=2,precision=fp32", global_batch=8, measured=meas)
    assert priced.step_time_s > 0
    report = plan(spec, cluster, global_batch=8, precision="fp32", measured=meas, explain_choice=False)
    assert report.best.feasible


def test_measured_mapping_is_validated() -> None:
    with pytest.raises(TypeError):
        Measured.coerce(3.0)
