"""litgpt's GPT (a tiny Llama-style config) in a LightningModule, for the pipeline tests: the model is litgpt's
own, unchanged; only the loss is ours."""

from __future__ import annotations

from common import LitLM


LitLitGPT = LitLM  # litgpt's GPT returns logits: the shared wrapper serves as it is


def make_litgpt_module(**_: object) -> LitLitGPT:
    from common import SEQ, VOCAB
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(n_layer=4, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    block_size=SEQ, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=64,
                    norm_class_name="RMSNorm", rotary_percentage=1.0, parallel_residual=False)
    return LitLitGPT(GPT(config))
