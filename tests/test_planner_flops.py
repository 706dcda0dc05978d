"""Analytic FLOPs (planner/cost.py) against torch's FlopCounterMode on the reference GPT."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_autopar.models import GPT, GPTConfig
from lightning_autopar.planner import cost as C
from lightning_autopar.specs import ModelSpec


def spec_of(cfg: GPTConfig) -> ModelSpec:
    return ModelSpec(name="t", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                     ffn_hidden=cfg.ffn_hidden, ffn_kind=cfg.ffn_kind, vocab=cfg.vocab, seq_len=cfg.seq_len,
                     experts=cfg.experts, top_k=cfg.top_k, moe_every=cfg.moe_every)


@pytest.mark.parametrize("kw", [
    {},  # gelu MHA
    {"kv_heads": 2, "ffn_kind": "swiglu"},  # GQA + swiglu
    {"experts": 4, "top_k": 2, "moe_every": 2, "layers": 2},  # MoE every other block
    {"hidden": 96, "heads": 6, "ffn_hidden": 200, "seq_len": 48, "vocab": 100},
])
def test_forward_flops_match_flop_counter(kw: dict) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(**kw)
    model = GPT(cfg)
    batch = 3
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len))
    # the math SDPA backend decomposes attention into bmm, which FlopCounterMode counts (matmuls + SDPA)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd:
        out = model(x)
    assert fwd.get_total_flops() == C.forward_flops(spec_of(cfg), batch, cfg.seq_len)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as bwd:
        out.float().sum().backward()
    assert bwd.get_total_flops() == 2 * fwd.get_total_flops()  # backprop: dX and dW per matmul


def test_term_split() -> None:
    spec = spec_of(GPTConfig())
    b, s = 2, 64
    T = b * s
    h, f, V = 64, 256, 256
    assert C.qkv_flops(spec, T) == 2 * T * h * 3 * h
    assert C.out_proj_flops(spec, T) == 2 * T * h * h
    assert C.attention_core_flops(spec, b, s) == 4 * b * s * s * h
    assert C.mlp_flops(spec, T) == 2 * T * h * f * 2
    assert C.lm_head_flops(spec, T) == 2 * T * h * V
    # the MFU numerator: 3 x forward per token with the full s^2 term (no causal saving, no recompute)
    assert C.model_flops_per_token(spec, s) == pytest.approx(3 * C.forward_flops(spec, 1, s) / s)


def test_causal_fraction() -> None:
    assert C.causal_fraction(128) == pytest.approx(1.0)  # one block: the diagonal is the whole
    assert C.causal_fraction(8192) == pytest.approx((64 + 1) / 128)
