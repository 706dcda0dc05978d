"""A tiny Hugging Face Llama and Mixtral for the equivalence tests (shapes as tests/dist/common.py's GPT)."""

from __future__ import annotations

MOE_AUX_COEF = 0.5  # large, so a balance loss that were not exact under data parallelism would show


def make_hf_module():
    from common import SEQ, VOCAB

    from lightning_autopar.models.hf import LitCausalLM, causal_lm
    from lightning_autopar.specs import ModelSpec

    spec = ModelSpec(name="llama-test", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, ffn_kind="swiglu",
                     vocab=VOCAB, seq_len=SEQ)
    return LitCausalLM(causal_lm(spec), lr=0.1, optimizer="sgd", momentum=0.9)


def make_hf_moe_module():
    """A tiny MixtralForCausalLM (4 experts, top-2; fused 3-D expert weights) with its balance loss on."""
    from common import SEQ, VOCAB

    from lightning_autopar.models.hf import LitCausalLM, causal_lm
    from lightning_autopar.specs import ModelSpec

    spec = ModelSpec(name="mixtral-test", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64,
                     ffn_kind="swiglu", vocab=VOCAB, seq_len=SEQ, experts=4, top_k=2)
    model = causal_lm(spec)
    model.config.router_aux_loss_coef = MOE_AUX_COEF
    return LitCausalLM(model, lr=0.1, optimizer="sgd", momentum=0.9)


def hf_reference_run(steps: int, make=None, clip: float | None = None):
    """The single-process loop for the tiny Llama (or ``make()``'s module): (losses, state dict)."""
    from common import reference_run

    return reference_run(steps, clip=clip, make=make or make_hf_module)
