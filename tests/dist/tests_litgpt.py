"""litgpt's GPT (a tiny Llama-style config) in a LightningModule, for the pipeline tests: the model is litgpt's
own, unchanged; only the loss is ours."""

from __future__ import annotations

import lightning.pytorch as L
import torch


class LitLitGPT(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        return lm_loss(self.model(idx), targets)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def make_litgpt_module(**_: object) -> LitLitGPT:
    from common import SEQ, VOCAB
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(n_layer=4, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    block_size=SEQ, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=64,
                    norm_class_name="RMSNorm", rotary_percentage=1.0, parallel_residual=False)
    return LitLitGPT(GPT(config))
