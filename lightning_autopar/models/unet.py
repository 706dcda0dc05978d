"""A plain 3D U-Net (Cicek et al. 2016; nnU-Net-like widths): Conv3d + GroupNorm + LeakyReLU blocks, max-pool
down, ConvTranspose3d up, skip connections concatenated. Plain PyTorch, no parallelism inside: the unit-form
preset (``configs/model/unet3d.yaml``, ``autopar analyze``) and an example of a model without repeated blocks."""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock3d(nn.Module):
    """Two 3x3x3 convolutions, each followed by GroupNorm(8) and LeakyReLU."""

    def __init__(self, cin: int, cout: int, groups: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.LeakyReLU(0.01),
                                 nn.Conv3d(cout, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.LeakyReLU(0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Down3d(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int = 8) -> None:
        super().__init__()
        self.pool, self.block = nn.MaxPool3d(2), ConvBlock3d(cin, cout, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.pool(x))


class Up3d(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int = 8) -> None:
        super().__init__()
        self.up, self.block = nn.ConvTranspose3d(cin, cout, 2, stride=2), ConvBlock3d(2 * cout, cout, groups)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], 1))


class UNet3d(nn.Module):
    """``widths`` per level (the input level first); input (batch, in_channels, D, H, W) with D, H, W divisible by
    2 ** (levels - 1); output (batch, classes, D, H, W) logits."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256, 320), in_channels: int = 1, classes: int = 3,
                 groups: int = 8) -> None:
        super().__init__()
        self.enc0 = ConvBlock3d(in_channels, widths[0], groups)
        self.downs = nn.ModuleList(Down3d(a, b, groups) for a, b in zip(widths[:-1], widths[1:]))
        self.ups = nn.ModuleList(Up3d(b, a, groups) for a, b in zip(widths[:-1][::-1], widths[1:][::-1]))
        self.head = nn.Conv3d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.enc0(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)
