"""Models that are not transformers, for the any-model equivalence tests (issue 13): Hugging Face ResNet (bottleneck,
BatchNorm), a plain CNN (Conv2d, BatchNorm2d, pooling) and a plain 3D U-Net (Conv3d, GroupNorm, skip connections
with torch.cat, ConvTranspose3d), each in one plain LightningModule, plus their data and the single-process
reference loop (the strategy's batch semantics: one DataLoader batch = the global batch of one step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_autopar.models.unet import ConvBlock3d

from common import LitLM  # noqa: E402  (tests/dist is on the path of whatever imports this file)

GLOBAL_BATCH = 8
BATCHES_PER_EPOCH = 2
STEPS = 4
CLASSES = 3


class PlainCNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> MaxPool, twice, then global pooling and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=None), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


class UNet3d(nn.Module):
    """Two levels: the encoder's first output is concatenated into the decoder (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = ConvBlock3d(1, 4, groups=2)
        self.enc2 = ConvBlock3d(4, 8, groups=2)
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec1 = ConvBlock3d(8, 4, groups=2)
        self.out = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc1(x)
        deep = self.enc2(F.max_pool3d(skip, 2))
        return self.out(self.dec1(torch.cat([skip, self.up(deep)], dim=1)))


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="bottleneck", num_labels=CLASSES)
    return ResNetForImageClassification(config)


class LitVision(LitLM):
    """A user's plain LightningModule (``common.LitLM``'s step and SGD with momentum) with a cross-entropy loss on
    images. ``call`` maps the model and the input to logits (Hugging Face takes ``pixel_values=`` and returns an
    output object)."""

    def __init__(self, model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__(model)
        self.call = call

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.call(self.model, x), y)


@dataclass(frozen=True)
class VisionCase:
    make: Callable[[], L.LightningModule]
    data: Callable[[], TensorDataset]
    batchnorm: bool


def _images(shape: tuple[int, ...], target: tuple[int, ...], classes: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    n = GLOBAL_BATCH * BATCHES_PER_EPOCH
    images = torch.randn((n, *shape), generator=gen)
    return TensorDataset(images, torch.randint(0, classes, (n, *target), generator=gen))


MODELS: dict[str, VisionCase] = {
    "resnet": VisionCase(lambda: LitVision(hf_resnet(), lambda m, x: m(pixel_values=x).logits),
                         lambda: _images((3, 16, 16), (), CLASSES), batchnorm=True),
    "cnn": VisionCase(lambda: LitVision(PlainCNN(), lambda m, x: m(x)), lambda: _images((3, 8, 8), (), CLASSES),
                      batchnorm=True),
    "unet": VisionCase(lambda: LitVision(UNet3d(), lambda m, x: m(x)), lambda: _images((1, 8, 8, 8), (8, 8, 8), 2),
                       batchnorm=False),
}


def reference_run(name: str, steps: int = STEPS, micro_batches: int = 1, dp: int = 1, seed: int = 0):
    """The plain single-process loop (``common.reference_run``) for ``name``: (losses per step, state dict incl.
    buffers). With ``micro_batches > 1`` it takes the strategy's micro-batches, so BatchNorm normalises over the
    same rows as under the plan."""
    from common import reference_run as loop

    case = MODELS[name]
    return loop(steps, seed=seed, micro_batches=micro_batches, dp=dp, make=case.make, data=case.data())
