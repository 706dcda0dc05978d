"""A vision model trained with strategy="autopar": a Hugging Face ResNet (BatchNorm) or ViT, unchanged.

Single-device Lightning code: a thin LightningModule computing cross-entropy on the model's logits
(``lightning_autopar.models.vision.LitImageClassifier``) over a generated image set (``ShapesDataset``: one bright
square per class on noise; no download). A Hydra app over ``configs/train_vision.yaml`` (the main job's schema,
``vision`` section from ``configs/vision/``). Runs on 4 CPU processes here, or on all GPUs when CUDA is present:

    python examples/train_vision.py                                  # tiny ResNet, 4 CPU processes
    python examples/train_vision.py vision=vit_tiny                  # tiny ViT (tensor parallel is possible)
    python examples/train_vision.py vision=vit_tiny planner.fix="tp=2"
    python examples/train_vision.py planner.fix="zero=3" trainer.devices=2

The plan table shows the model's units and why the winner wins; BatchNorm statistics are synchronised over the
data-parallel ranks, so the run trains as one device would on the same global batch.
"""

from __future__ import annotations

import lightning.pytorch as L
from torch.utils.data import DataLoader

import lightning_autopar  # noqa: F401  (registers strategy="autopar")
from lightning_autopar.config import TrainConfig, hydra_app, trainer_from_config
from lightning_autopar.models.vision import LitImageClassifier, ShapesDataset, image_classifier


def train_vision(cfg: TrainConfig) -> L.Trainer:
    L.seed_everything(cfg.seed)
    v = cfg.vision
    data = DataLoader(ShapesDataset(v.samples, v.image_size, v.channels, v.classes, seed=cfg.seed),
                      batch_size=cfg.data.batch_size, shuffle=cfg.data.shuffle, drop_last=True)
    module = LitImageClassifier(image_classifier(v), lr=cfg.optim.lr, optimizer=cfg.optim.name,
                                weight_decay=cfg.optim.weight_decay, momentum=cfg.optim.momentum)
    trainer = trainer_from_config(cfg, data)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"final train_loss {float(metrics['train_loss']):.3f} train_acc {float(metrics['train_acc']):.3f}")
    return trainer


if __name__ == "__main__":
    hydra_app(train_vision, config_name="train_vision")
