"""Memory terms: ZeRO model-state formulas and the Korthikanti et al. (2022) activation formulas."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate
from lightning_autopar.specs import ModelSpec

BF16, FP32 = 1, 0


@pytest.mark.parametrize("dp", [1, 2, 8, 64])
def test_zero_stages_mixed_adam(dp: int) -> None:
    P = 1e9  # 16 bytes/param: 2 weights + 2 grads + 12 optimizer (fp32 master, m, v)
    assert C.model_state_bytes(P, 0, dp, BF16) == 16 * P
    assert C.model_state_bytes(P, 1, dp, BF16) == pytest.approx(2 * P + 2 * P + 12 * P / dp)
    assert C.model_state_bytes(P, 2, dp, BF16) == pytest.approx(2 * P + (2 + 12) * P / dp)
    assert C.model_state_bytes(P, 3, dp, BF16) == pytest.approx(16 * P / dp)


def test_zero_fp32_adam() -> None:
    P = 1e6  # 4 weights + 4 grads + 8 (m, v)
    assert C.model_state_bytes(P, 0, 4, FP32) == 16 * P
    assert C.model_state_bytes(P, 2, 4, FP32) == pytest.approx(4 * P + 12 * P / 4)


def test_zero_vectorised() -> None:
    zero = np.array([0, 1, 2, 3])
    out = C.model_state_bytes(np.full(4, 100.0), zero, np.full(4, 4.0), np.full(4, 1))
    assert out.tolist() == [1600.0, 400 + 300.0, 200 + 350.0, 400.0]


GPT = ModelSpec(name="gpt", layers=2, hidden=1024, heads=16, vocab=1000, seq_len=2048)  # f = 4h, gelu, MHA


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_per_layer(t: int) -> None:
    s, b, h, a = 2048, 2, 1024, 16
    act = lambda rc, sp, fused=False: float(C.activation_bytes_per_block(GPT, b, s, t, sp, 1, rc, 2.0, fused))  # noqa: E731
    # Table 2 of Korthikanti et al. 2022 (bytes, 16-bit activations, with dropout masks)
    assert act(0, False) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(1, False) == pytest.approx(s * b * h * (10 + 24 / t))
    assert act(2, False) == pytest.approx(2 * s * b * h)
    if t > 1:
        # SP (Table 2): sbh(34/t + 5as/(ht)); with selective recompute 34sbh/t. The attention's and the MLP's inputs
        # are saved as this rank's chunk and gathered again in backward (parallel/tp_comm.ColumnFromChunk)
        assert act(0, True) == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
        assert act(1, True) == pytest.approx(34 * s * b * h / t)
        assert act(2, True) == pytest.approx(2 * s * b * h / t)
    if t == 1:
        assert act(0, False) == pytest.approx(34 * s * b * h + 5 * a * s * s * b)
    # fused (flash) attention keeps no s^2 tensors: same as selective
    assert act(0, False, fused=True) == pytest.approx(act(1, False))
    # blocks without dropout (Llama) keep no masks: 2sbh less (/t with SP)
    plain = ModelSpec(**{**GPT.__dict__, "dropout": False})
    no_masks = lambda rc, sp: float(C.activation_bytes_per_block(plain, b, s, t, sp, 1, rc, 2.0, True))  # noqa: E731
    assert no_masks(1, False) == pytest.approx(s * b * h * (8 + 24 / t))
    if t > 1:
        assert no_masks(1, True) == pytest.approx(32 * s * b * h / t)


def test_inflight_microbatches() -> None:
    gpipe, one_f, inter = 0, 1, 2
    assert C.inflight_microbatches(gpipe, 4, 1, 16, 0) == 16
    assert C.inflight_microbatches(one_f, 4, 1, 16, 0) == 4  # first stage holds pp
    assert C.inflight_microbatches(one_f, 4, 1, 16, 3) == 1  # last stage holds one
    assert C.inflight_microbatches(one_f, 4, 1, 2, 0) == 2  # never more than there are
    # interleaved, first rank: (2(p-1) + (v-1)p + 1) chunks of 1/v stage: 1 + (p-1)/(p v) stages' worth x p
    assert C.inflight_microbatches(inter, 4, 2, 16, 0) == pytest.approx((2 * 3 + 4 + 1) / 2)


def test_estimate_zero_difference_is_the_formula() -> None:
    """ZeRO's formula (cost.model_state_bytes): between stage 1 and 2 only the sharded gradients change,
    2P(1 - 1/dp) bytes per device. The runtime runs stage 1 as stage 2 (FSDP2 reduce-scatters the gradients:
    parallel/fsdp.py), so the priced plans hold the same memory (measured: tests/test_memory_truth.py)."""
    spec = ModelSpec(name="m", layers=4, hidden=512, heads=8, vocab=1000, seq_len=256)
    P = float(spec.total_params())
    zeros = np.array([1, 2])
    formula = C.model_state_bytes(np.full(2, P), zeros, np.full(2, 8.0), np.full(2, 1))  # bf16 code 1
    assert formula[0] - formula[1] == pytest.approx(2 * P * (1 - 1 / 8), rel=1e-9)
    cluster = "a100-80g-dgx"
    m1 = estimate(spec, cluster, "dp=8,zero=1,mbs=1,precision=bf16-mixed", global_batch=8)
    m2 = estimate(spec, cluster, "dp=8,zero=2,mbs=1,precision=bf16-mixed", global_batch=8)
    assert m1.memory_gib_per_device == pytest.approx(m2.memory_gib_per_device, rel=1e-9)


def test_memory_feasibility_flag() -> None:
    spec = "gpt3-175b"
    priced = estimate(spec, "a100-80g-dgx", "dp=8,zero=0,mbs=1,precision=bf16-mixed", global_batch=8)
    assert not priced.feasible and priced.reason.startswith("memory")
    assert priced.memory_gib_per_device > 16 * 174e9 / 2**30  # all model states on every device
