"""A tiny Hugging Face Llama for the equivalence tests (shapes as tests/dist/common.py's GPT)."""

from __future__ import annotations


def make_hf_module():
    from common import SEQ, VOCAB

    from lightning_autopar.models.hf import LitCausalLM, causal_lm
    from lightning_autopar.specs import ModelSpec

    spec = ModelSpec(name="llama-test", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, ffn_kind="swiglu",
                     vocab=VOCAB, seq_len=SEQ)
    return LitCausalLM(causal_lm(spec), lr=0.1, optimizer="sgd", momentum=0.9)


def hf_reference_run(steps: int):
    """The single-process loop for the tiny Llama: (losses, state dict)."""
    import lightning.pytorch as L
    from common import BATCHES_PER_EPOCH, GLOBAL_BATCH, make_data

    L.seed_everything(0, verbose=False)
    module = make_hf_module()
    opt = module.configure_optimizers()
    data = make_data()
    losses = []
    for step in range(steps):
        i = step % BATCHES_PER_EPOCH
        loss = module.loss(data[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
