"""Trainable modules the trace on token ids never reached, under FSDP: one line instead of a hang.

A vision-language model's projector (and a trained tower) runs only for a batch with images. FSDP2 reduce-scatters
the parameters of a unit that have a gradient, so when one data-parallel rank's batch has no image and another's
has, the ranks reduce different tensors: gloo aborts the process ("Received data size doesn't match"), NCCL hangs.
DDP is told to find unused parameters instead (``apply._unreached``), which handles it. Under FSDP each forward
of the model records whether those modules ran; after it, the data-parallel ranks compare (one all-reduce of a
few flags), and where some ran them and others did not, every rank raises the same ``ConfigError`` naming the
module and the fix, before any backward. Not inside a pipeline: there a stage's forward runs inside torch's
schedule, and the same check hung a world-4 run (pp=2, dp=2) before its first step; a pipeline whose
data-parallel ranks disagree still aborts (gloo) or hangs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_autopar.errors import ConfigError


class ReachCheck:
    """Flags per module of ``names`` (root-relative) set by their forward pre-hooks; ``check`` (a forward hook on
    ``model``, the module the training step calls) compares them over ``group``."""

    def __init__(self, root: nn.Module, names: list[str], model: nn.Module, group: Any,
                 device: torch.device) -> None:
        self.names = names
        self.group, self.device = group, device
        self.ran = [False] * len(names)
        self.handles = [root.get_submodule(n).register_forward_pre_hook(self._mark(i)) for i, n in enumerate(names)]
        self.handles.append(model.register_forward_hook(lambda module, args, out: self.check()))

    def _mark(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.ran[index] = True

        return hook

    def check(self) -> None:
        if not torch.is_grad_enabled():  # evaluation: no gradient to reduce
            self.ran = [False] * len(self.names)
            return
        ran = torch.tensor([float(r) for r in self.ran] + [1.0 - float(r) for r in self.ran], device=self.device)
        self.ran = [False] * len(self.names)
        dist.all_reduce(ran, op=dist.ReduceOp.MAX, group=self.group)
        n = len(self.names)
        split = [i for i in range(n) if ran[i] > 0 and ran[n + i] > 0]
        if split:
            name = self.names[split[0]]
            raise ConfigError("plan.zero", f"'{name}' ran in some data-parallel ranks' batches and not in others' "
                              "(a batch without images, say): FSDP would reduce different gradients on each",
                              "use zero=0 with tp=1 and pp=1 (DDP, which finds unused parameters), or batches that run it "
                              "on every rank")


def unreached_modules(root: nn.Module, names: list[str]) -> list[str]:
    """The outermost modules all of whose trainable parameters are among ``names`` (root-relative), each holding
    some: a VLM's tower and projector, not their layers."""
    unreached = set(names)
    trainable = {n for n, p in root.named_parameters() if p.requires_grad}

    def whole(module_name: str) -> bool:
        inside = {n for n in trainable if n.startswith(module_name + ".")}
        return bool(inside) and inside <= unreached

    found: list[str] = []
    for name in names:
        parts = name.split(".")[:-1]
        top = next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if whole(".".join(parts[:i]))), None)
        if top is not None and top not in found:
            found.append(top)
    return found
