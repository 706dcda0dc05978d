"""The data-parallel group a step reduces its logged values over, and the start from rank 0's weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DataParallelGroup:
    """The flat data-parallel sub-mesh (``MeshLayout["dp_flat"]``) and the device its collectives run on."""

    mesh: Any  # DeviceMesh
    device: torch.device

    def rank_and_size(self) -> tuple[int, int]:
        return self.mesh.get_local_rank(), self.mesh.size()

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group; returned on the CPU (where the log recorder keeps its values)."""
        import torch.distributed as dist

        if self.mesh.size() > 1:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor, group=self.mesh.get_group())
        return tensor.cpu()


def broadcast_module(module: nn.Module) -> None:
    """Start every rank from rank 0's weights: the model the user built is the model trained."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.device.type != "meta":
                dist.broadcast(tensor.data, src=0)


def dp_mesh(layout: Any, plan: Any) -> Any:
    """The mesh data parallelism shards / replicates over (``topology.mesh.MeshLayout.dp_mesh``; ``layout`` is
    one built for a plan of ``plan``'s shape): 2-D for HSDP (and DDP as HSDP with shard groups of one), else the shard
    dimension; with cp, over data-parallel x cp ranks."""
    return layout.dp_mesh(plan)
