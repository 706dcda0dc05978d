"""LightningModules around the reference GPT: single-device code, no parallelism anywhere."""

from __future__ import annotations

import torch
import lightning.pytorch as L

from lightning_autopar.models.gpt import GPT, GPTConfig, lm_loss


class LitGPT(L.LightningModule):
    """Next-token prediction on (inputs, targets) batches; logs ``train_loss`` (and ``val_loss``)."""

    def __init__(self, config: GPTConfig | None = None, lr: float = 0.1, momentum: float = 0.9,
                 optimizer: str = "sgd", weight_decay: float = 0.0) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.model = GPT(self.config)
        self.lr, self.momentum, self.optimizer_name, self.weight_decay = lr, momentum, optimizer, weight_decay

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        loss = lm_loss(self.model(idx), targets)
        if self.config.experts:
            loss = loss + self.model.aux_loss()
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
