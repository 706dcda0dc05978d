"""The vision example's config section (``TrainConfig.vision``): a plain dataclass beside the models it shapes, so
``models.vision`` reads it without importing the app config (which builds strategies and Trainers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_autopar.errors import ConfigError

VISION_ARCHS = ("resnet", "vit")


@dataclass
class VisionConfig:
    """The vision example's model and its generated images (``configs/vision/*.yaml``; built by
    ``lightning_autopar.models.vision``). Unused by the language-model apps."""

    arch: str = "resnet"  # resnet: ResNetForImageClassification (bottleneck, BatchNorm); vit: ViTForImageClassification
    image_size: int = 32
    channels: int = 3
    classes: int = 4
    width: int = 16  # resnet: the first stage's width (doubling per stage); vit: the hidden size
    depths: list[int] = field(default_factory=lambda: [1, 1])  # resnet: blocks per stage; vit: [layers]
    heads: int = 4  # vit only
    patch: int = 8  # vit only
    samples: int = 1024  # images in the generated set

    def validate(self) -> None:
        if self.arch not in VISION_ARCHS:
            raise ConfigError("vision.arch", f"unknown {self.arch!r}", f"use one of {', '.join(VISION_ARCHS)}")
        for name in ("image_size", "channels", "classes", "width", "heads", "patch", "samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"vision.{name}", f"must be a positive integer, got {value!r}")
        if not self.depths or any(d < 1 for d in self.depths):
            raise ConfigError("vision.depths", f"must be a non-empty list of positive integers, got {self.depths}")
        if self.classes < 2:
            raise ConfigError("vision.classes", "needs at least 2 classes")
        if self.arch == "vit":
            if self.image_size % self.patch:
                raise ConfigError("vision.patch", f"{self.patch} does not divide image_size={self.image_size}",
                                  "choose a patch size dividing the image size")
            if self.width % self.heads:
                raise ConfigError("vision.heads", f"{self.heads} does not divide width={self.width}",
                                  "choose heads dividing the width (the hidden size)")
