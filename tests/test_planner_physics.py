"""The cost model's efficiency and overhead terms on hand-computed cases: GEMM pipeline fill, attention kernel rates,
memory-bound ops, FSDP copies, overlap interference, MoE load imbalance, slowest device, host dispatch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate
from lightning_autopar.specs import ClusterSpec, DeviceSpec, LinkSpec, ModelSpec, PeakTflops, load_cluster_spec

PEAK = 300e12


def gpu(**kw) -> ClusterSpec:
    dev = DeviceSpec(name="gpu", memory_gib=80, peak_tflops=PeakTflops(bf16=300, fp16=300, fp32=20),
                     memory_bandwidth_gbs=2000, memory_efficiency=1.0, gemm_efficiency=0.8, compute_units=100,
                     tile=128, kernel_overhead_us=0.0, **kw)
    return ClusterSpec(name="t", nodes=2, devices_per_node=8, device=dev,
                       links=[LinkSpec("node", 100.0, 5.0), LinkSpec("cluster", 10.0, 5.0)])


GPT = ModelSpec(name="g", layers=4, hidden=1024, heads=8, vocab=1000, seq_len=2048)  # gelu, f = 4h, d = 128
LLAMA = ModelSpec(name="l", layers=4, hidden=1024, heads=8, kv_heads=2, ffn_hidden=2816, ffn_kind="swiglu",
                  vocab=1000, seq_len=2048)


def test_gemm_pipeline_fill_per_wave() -> None:
    hw = C.Hardware.from_cluster(gpu())
    # 1280 x 1280 output = 100 tiles = one wave on 100 units: 2mnk/(peak*eta) + one fill
    m = n = 1280
    for k in (256, 8192):
        expected = 2 * m * n * k / (PEAK * 0.8) + C.TILE_FILL_S
        assert C.gemm_time(hw, m, n, k, PEAK, 2.0) == pytest.approx(expected)
    # the fill weighs on short reductions (small k after TP splits), not on long ones
    eff = lambda k: 2 * m * n * k / PEAK / float(C.gemm_time(hw, m, n, k, PEAK, 2.0))  # noqa: E731
    assert eff(256) < 0.7 < 0.79 < eff(8192) < 0.8


def test_attention_kernel_rates_per_device() -> None:
    for name in ("a100-80g-dgx", "h100-sxm-dgx", "h200-sxm-dgx"):
        spec = load_cluster_spec(name)
        dev = spec.device
        assert 0 < dev.attention_bwd_efficiency < dev.attention_efficiency < dev.gemm_efficiency
        hw = C.Hardware.from_cluster(spec)  # one node: the slowest-device factor is that of 8 devices
        slow = C.slowest_device_factor(8, dev.throughput_cv)
        assert C.attention_efficiency(hw, 128) == pytest.approx(dev.attention_efficiency * slow)
        assert C.attention_efficiency(hw, 128, backward=True) == pytest.approx(dev.attention_bwd_efficiency * slow)
        assert C.attention_efficiency(hw, 64) < C.attention_efficiency(hw, 128)  # the exp share grows as d shrinks
    # FlashAttention-2 on Hopper (mma.sync) reaches a smaller share of peak than on Ampere
    a100, h100 = (load_cluster_spec(n).device for n in ("a100-80g-dgx", "h100-sxm-dgx"))
    assert h100.attention_efficiency < a100.attention_efficiency
    # no kernel figure: the older derivation (matmul rate less the exp share), backward at the forward's rate
    hw = C.Hardware.from_cluster(gpu())
    assert C.attention_efficiency(hw, 128) == pytest.approx(0.8 * 128 / 160)
    assert C.attention_efficiency(hw, 128, backward=True) == C.attention_efficiency(hw, 128)


def test_attention_work_quantisation() -> None:
    hw = C.Hardware.from_cluster(gpu())
    # 8 x 32 heads x 16 query blocks = 4096 CTAs on 200 slots: 21 waves; causal mean K/V blocks visited n = 8.5
    q = C.attention_work_quantisation(hw, 8, 32, 2048, 2048)
    assert q == pytest.approx(8.5 / 9.5 * 4096 / (21 * 200))
    assert C.attention_work_quantisation(hw, 8, 32, 8192, 8192) > q  # longer rows amortise the Q load / O store
    fwd, bwd = C.attention_time(hw, GPT, 8, 2048, 1, 1, PEAK, 2.0)  # 8 heads: 1024 CTAs, 6 waves of 200
    flops = C.attention_core_flops(GPT, 8, 2048, C.causal_fraction(2048))
    assert float(fwd) == pytest.approx(flops / (PEAK * 0.64 * 8.5 / 9.5 * 1024 / 1200))
    assert float(bwd) > 2.5 * float(fwd)  # 2.5x the FLOPs plus the preprocess and dq conversion passes


def test_block_memory_ops_hand_count() -> None:
    h, f = 1024, 4096
    fwd, bwd, kf, kb = C.block_memory_ops(GPT, 1, False)
    # norms 2x(2h), residual adds 2x(3h), attention-output copy 2h, gelu 2f | norms 2x(5h), adds 2x(3h), copy, gelu' 3f
    assert fwd == pytest.approx(4 * h + 6 * h + 2 * h + 2 * f) and (kf, kb) == (6, 8)
    assert bwd == pytest.approx(10 * h + 6 * h + 2 * h + 3 * f)
    # sequence parallel splits the replicated part; the TP-split part is split either way
    fwd_sp, _, _, _ = C.block_memory_ops(GPT, 4, True)
    assert fwd_sp == pytest.approx((12 * h + 2 * f) / 4)
    # swiglu (Llama-style): silu + mul (5f), RoPE on q and k (7 passes over h + kv_heads*d), and two eager fp32
    # RMSNorms (cost.norm_traffic: 36 B = 18 bf16 elements in 8 kernels fwd, 92 B = 46 elements in 16 kernels bwd)
    fwd_l, bwd_l, kf_l, kb_l = C.block_memory_ops(LLAMA, 1, False)
    kvd = 2 * 128
    assert fwd_l == pytest.approx(2 * 18 * h + 8 * h + 5 * 2816 + 7 * (h + kvd)) and (kf_l, kb_l) == (29, 46)
    assert bwd_l == pytest.approx(2 * 46 * h + 8 * h + 9 * 2816 + 7 * (h + kvd))


def test_cross_entropy_and_embedding_passes() -> None:
    hw = C.Hardware.from_cluster(gpu())
    T, V, h = 4096, 1000, 1024
    hf, hb = C.head_time(hw, GPT, 2, 2048, 1, 1, PEAK, 2.0)
    gf, gb = C.gemm_fwd_bwd(hw, T, V, h, PEAK, 2.0)
    bw = 2000e9
    assert float(hf - gf) == pytest.approx(T * V * (2 + 16) / bw + 2 * T * h * 2 / bw)
    assert float(hb - gb) == pytest.approx(T * V * (2 + 20) / bw + 5 * T * h * 2 / bw)
    _, eb = C.embedding_time(hw, GPT, 2, 2048, 1, 2.0, tp=2)
    assert float(eb) == pytest.approx((3 * T * h * 2 + V / 2 * h * 2) / bw)  # scatter-add + zero-filled weight grad


def test_parameter_memory_work() -> None:
    hw = C.Hardware.from_cluster(gpu())
    P, bw = 1e9, 2000e9
    assert C.grad_accumulate_time(hw, P, 1) == pytest.approx(10 * P / bw)  # r bf16 grad, r/w fp32 accumulator
    assert C.grad_accumulate_time(hw, P, 0) == pytest.approx(12 * P / bw)
    # FSDP2 bf16: a gather = cast copy-in of the shard (4+2)/N + copy-out 2+2; a reduce = cast 2+4 + 12/N after
    assert C.shard_copy_time(hw, P, 8, 1, 2, 1) == pytest.approx(P * (2 * (6 / 8 + 4) + 6 + 12 / 8) / bw)
    assert C.optimizer_time(hw, P, 1) == pytest.approx(P * (28 + 4 + 12) / bw)  # Adam + half copy + norm/clip


def test_overlap_interference() -> None:
    # hidden: compute runs on 1-f of the SMs while the collective is in flight
    assert C.overlapped_exposed(1.0, 5.0, 0.1, 0.15) == pytest.approx(0.1 + 0.15 * 0.9)
    # not hidden: the collective's excess over the window
    assert C.overlapped_exposed(8.0, 5.0, 0.1, 0.15) == pytest.approx(3.0)
    assert C.overlapped_exposed(1.0, 5.0, 0.1, 0.0) == pytest.approx(0.1)  # f = 0: the older max(c - W, tail)
    base = gpu()
    contended = dataclasses.replace(base, device=dataclasses.replace(base.device, comm_sm_fraction=0.15))
    text = "dp=8,tp=2,zero=3,mbs=2,precision=bf16-mixed"
    a = estimate("gpt3-1.3b", base, text, global_batch=32)
    b = estimate("gpt3-1.3b", contended, text, global_batch=32)
    assert b.step_time_s > a.step_time_s
    assert b.memory_gib_per_device == a.memory_gib_per_device


def test_gradients_reduced_in_fp32() -> None:
    # nothing hides communication: the exposed DP all-reduce is the same for bf16-mixed and fp32 (4-byte gradients)
    base = gpu()
    serial = dataclasses.replace(base, device=dataclasses.replace(base.device, comm_overlap=0.0))
    est = lambda p: estimate("gpt3-1.3b", serial, f"dp=16,zero=0,mbs=1,precision={p}", global_batch=16)  # noqa: E731
    assert est("bf16-mixed").breakdown.comm_exposed_s == pytest.approx(est("fp32").breakdown.comm_exposed_s, rel=1e-5)


def test_moe_imbalance_matches_simulation() -> None:
    rng = np.random.default_rng(0)
    for ranks, mean in ((2, 64), (8, 256), (8, 4096)):
        loads = rng.multinomial(ranks * mean, [1 / ranks] * ranks, size=4000)
        simulated = loads.max(axis=1).mean() / mean
        assert float(C.moe_load_imbalance(mean, ranks)) == pytest.approx(simulated, rel=0.01)
    assert float(C.moe_load_imbalance(1000, 1)) == 1.0
    # the busiest rank's share shrinks as tokens grow, and the block gets slower with it, never faster
    assert C.moe_load_imbalance(100, 8) > C.moe_load_imbalance(10000, 8) > 1.0


def test_slowest_device() -> None:
    assert C.slowest_device_factor(1024, 0.0) == 1.0 and C.slowest_device_factor(1, 0.05) == 1.0
    z = float(C.normal_max_quantile(1024))
    assert z == pytest.approx(3.2, abs=0.1)  # expected max of 1024 standard normals ~3.2
    assert C.slowest_device_factor(1024, 0.01) == pytest.approx(1 - 0.01 * z)
    assert C.slowest_device_factor(8, 0.01) > C.slowest_device_factor(3072, 0.01)


def test_dispatch_floor() -> None:
    slow_host = gpu(dispatch_us=1000.0)  # 1 ms per eager op: the device waits on the host
    hw = C.Hardware.from_cluster(slow_host)
    blk = C.dense_block_time(hw, GPT, 1, 128, 1, 1, False, PEAK, 2.0)
    _, _, kf, kb = C.block_memory_ops(GPT, 1, False)
    gemms = 4 + GPT.ffn_matrices
    assert float(blk.fwd) == pytest.approx((gemms + 1 + kf) * 1e-3)
    assert float(blk.bwd) == pytest.approx((2 * gemms + 3 + kb) * 1e-3)
    fast = C.dense_block_time(C.Hardware.from_cluster(gpu()), GPT, 1, 128, 1, 1, False, PEAK, 2.0)
    assert float(fast.fwd) < float(blk.fwd)
