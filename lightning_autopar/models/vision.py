"""Vision models under autopar: small random-init Hugging Face image classifiers (ResNet with BatchNorm, ViT) built
from a VisionConfig, a generated image set, and a thin LightningModule computing the classification loss. The HF
model is used unchanged (extra ``hf``); the example is ``examples/train_vision.py``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_autopar.models.vision_config import VisionConfig
from lightning_autopar.models.hf import _transformers


def image_classifier(cfg: VisionConfig) -> torch.nn.Module:
    """A randomly initialised HF image classifier of the config's shape (seed with ``L.seed_everything`` first)."""
    cfg.validate()
    tf = _transformers()
    if cfg.arch == "resnet":
        sizes = [cfg.width * 2**i for i in range(len(cfg.depths))]
        config = tf.ResNetConfig(num_channels=cfg.channels, embedding_size=cfg.width, hidden_sizes=sizes,
                                 depths=list(cfg.depths), layer_type="bottleneck", num_labels=cfg.classes)
        return tf.ResNetForImageClassification(config)
    config = tf.ViTConfig(image_size=cfg.image_size, patch_size=cfg.patch, num_channels=cfg.channels,
                          hidden_size=cfg.width, num_hidden_layers=cfg.depths[0], num_attention_heads=cfg.heads,
                          intermediate_size=4 * cfg.width, num_labels=cfg.classes, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return tf.ViTForImageClassification(config)


class ShapesDataset(Dataset):
    """Generated images, deterministic per index: class k is a bright square at one of ``classes`` positions on
    a noisy background, so a small model learns it in a few hundred steps (no download, any size)."""

    def __init__(self, samples: int = 1024, image_size: int = 32, channels: int = 3, classes: int = 4,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (samples,), generator=gen)
        self.images = 0.3 * torch.randn(samples, channels, image_size, image_size, generator=gen)
        side = max(1, image_size // 4)
        grid = max(1, image_size // side)
        for i, label in enumerate(self.labels.tolist()):
            row, col = divmod(label % (grid * grid), grid)
            self.images[i, :, row * side:(row + 1) * side, col * side:(col + 1) * side] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class LitImageClassifier(L.LightningModule):
    """Any HF image classifier on (images, labels) batches: cross-entropy on the logits. Logs ``train_loss`` and
    ``train_acc``."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3, optimizer: str = "adamw",
                 weight_decay: float = 0.0, momentum: float = 0.9) -> None:
        super().__init__()
        self.model = model
        self.lr, self.optimizer_name, self.weight_decay, self.momentum = lr, optimizer, weight_decay, momentum

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self.model(pixel_values=images).logits
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == labels).float().mean(), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def resnet152(classes: int = 1000) -> torch.nn.Module:
    """Hugging Face ResNet-152 (He et al. 2016: bottleneck blocks 3, 8, 36, 3), random init; build it under
    ``torch.device("meta")`` to analyse it without memory (``autopar analyze``)."""
    tf = _transformers()
    config = tf.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 8, 36, 3],
                             layer_type="bottleneck", num_labels=classes)
    return tf.ResNetForImageClassification(config)
