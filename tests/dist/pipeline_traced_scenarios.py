"""Traced pipeline scenarios (parallel.pipeline.traced), run under torchrun: models that are not a block stack.

Usage: torchrun --nproc-per-node 2 tests/dist/pipeline_traced_scenarios.py OUT_DIR name[,name...]  (or in a batch)
Each scenario builds a ``TracedPipeline`` (pp = world size) and drives it the way the strategy drives a
``Pipeline``: the model call's (args, kwargs) captured per micro-batch, ``train_step`` running the schedule, the
loss function on the last stage rebuilding the model output and weighting the micro-batch loss, then an SGD step
on the (pruned) user module's parameters. Rank 0 writes OUT_DIR/<name>.pt: per-step losses, the union of every
rank's state dict (user names, buffers included), the eval-mode forward-only output, or the error.

The models and the single-process reference loop (``reference``) live here too; tests/test_pipeline_traced.py
compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 4
BATCH = 8
MICRO = 4  # micro-batches per step (micro-batch size 2)
LR, MOMENTUM = 0.05, 0.9


class PlainCNN(nn.Module):
    """Conv / BatchNorm / ReLU units with residuals crossing unit boundaries, then pooling and a linear head."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.stem(x)
        h1 = self.block1(h0) + h0
        h2 = self.block2(h1) + h1
        return self.head(F.adaptive_avg_pool2d(h2, 1).flatten(1))


def _conv3(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.ReLU())


class UNet3D(nn.Module):
    """A two-level 3D U-Net (Conv3d, GroupNorm): the encoder outputs are concatenated into the decoder, so they
    cross every split between them."""

    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.enc1 = _conv3(2, c)
        self.enc2 = _conv3(c, 2 * c)
        self.mid = _conv3(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose3d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = _conv3(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose3d(2 * c, c, 2, stride=2)
        self.dec1 = _conv3(2 * c, c)
        self.out = nn.Conv3d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool3d(e1, 2))
        m = self.mid(F.max_pool3d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(d1)


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="bottleneck", num_labels=4)
    return ResNetForImageClassification(cfg)


UNET_UNITS = ["enc1", "enc2", "mid", "up2", "dec2", "up1", "dec1", "out"]
RESNET_UNITS = ["resnet.embedder", "resnet.encoder.stages.0", "resnet.encoder.stages.1", "resnet.pooler",
                "classifier"]


def _images(shape: tuple[int, ...], classes: int, label_shape: Callable[[int], tuple[int, ...]]) -> Callable:
    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(BATCH, *shape, generator=gen)
        y = torch.randint(0, classes, label_shape(BATCH), generator=gen)
        return x, y
    return data


# name -> model factory, units, layers_per_stage (None: even), schedule, vpp, data(step), call(x) -> (args, kwargs)
MODELS: dict[str, dict[str, Any]] = {
    "cnn": dict(make=PlainCNN, units=["stem", "block1", "block2", "head"], data=_images((3, 8, 8), 5, lambda b: (b,)),
                call=lambda x: ((x,), {}), logits=lambda out: out),
    "unet": dict(make=UNet3D, units=UNET_UNITS, data=_images((2, 8, 8, 8), 3, lambda b: (b, 8, 8, 8)),
                 call=lambda x: ((x,), {}), logits=lambda out: out),
    "resnet": dict(make=hf_resnet, units=RESNET_UNITS, data=_images((3, 16, 16), 4, lambda b: (b,)),
                   call=lambda x: ((), {"pixel_values": x}), logits=lambda out: out.logits),
}
SCENARIOS: dict[str, tuple[str, str, int, list[int] | None]] = {
    "cnn_gpipe": ("cnn", "gpipe", 1, None),
    "cnn_1f1b": ("cnn", "1f1b", 1, [3, 1]),
    "unet_1f1b": ("unet", "1f1b", 1, None),
    "unet_interleaved": ("unet", "interleaved", 2, None),
    "resnet_1f1b": ("resnet", "1f1b", 1, [2, 3]),
}


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model]["make"]()


def micro_slices() -> list[slice]:
    rows = BATCH // MICRO
    return [slice(m * rows, (m + 1) * rows) for m in range(MICRO)]


def reference(model: str) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """The plain single-process loop: per step, every micro-batch forward and backward (loss / MICRO), one SGD
    step; then the eval-mode output on the next step's batch. Returns (losses, state dict, eval output)."""
    spec = MODELS[model]
    module = build(model)
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = spec["data"](step)
        total = 0.0
        for s in micro_slices():
            args, kwargs = spec["call"](x[s])
            loss = F.cross_entropy(spec["logits"](module(*args, **kwargs)), y[s]) / MICRO
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    module.eval()
    with torch.no_grad():
        args, kwargs = spec["call"](spec["data"](STEPS)[0])
        out = spec["logits"](module(*args, **kwargs))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}, out


def pipelined(name: str) -> dict[str, Any]:
    """The pipelined run of scenario ``name`` on this process group, driven like the strategy drives it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_autopar.parallel.pipeline import TracedPipeline

    model, schedule, vpp, layers = SCENARIOS[name]
    spec = MODELS[model]
    module = build(model)
    module.train()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    state: dict[str, Any] = {}

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        m = int(target.reshape(-1)[0])
        logits = spec["logits"](pipe.last_chunk.rebuild(output))
        loss = F.cross_entropy(logits, state["y"][micro_slices()[m]]) / MICRO
        if not pipe.inferring:
            state["losses"].append(float(loss.detach()))
        return loss

    x0, _ = spec["data"](0)
    example = spec["call"](x0[micro_slices()[0]])
    pipe = TracedPipeline(module, example, spec["units"], mesh["pp"], schedule, MICRO, torch.device("cpu"), loss_fn,
                          vpp=vpp, layers_per_stage=layers)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = spec["data"](step)
        state.update(y=y, losses=[])
        pipe.train_step([spec["call"](x[s]) for s in micro_slices()])
        opt.step()
        opt.zero_grad()
        losses.append(pipe.broadcast_from_last(sum(state["losses"]) if pipe.has_last else None))
    module.eval()
    out = pipe.forward_only(spec["call"](spec["data"](STEPS)[0]))  # the whole batch: another batch size
    out = pipe.broadcast_from_last(spec["logits"](out) if pipe.has_last else None)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().clone() for k, v in module.state_dict().items()})
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key in merged:
                raise RuntimeError(f"{key} is on two pipeline ranks")
            merged[key] = value
    return {"losses": losses, "state": merged, "eval": out,
            "params_per_rank": [len(p) for p in parts]}


def run(out_dir: Path, name: str) -> None:
    """Scenario ``name``: rank 0 writes OUT_DIR/<name>.pt. A rank's error leaves the others waiting in the
    schedule: it is raised, so the launch ends (a batch records it as the scenario's crash)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # the first scenario of a launch
        dist.init_process_group("gloo")
    result = pipelined(name)
    if dist.get_rank() == 0:
        torch.save(result, Path(out_dir) / f"{name}.pt")
    dist.barrier()


if __name__ == "__main__":
    from scenarios import main

    main(run)
