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


BROADCAST_BUCKET_BYTES = 32 << 20  # DDP syncs module states in 250 MiB buckets; a smaller one bounds the extra memory


def broadcast_module(module: nn.Module, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Start every rank from rank 0's weights: the model the user built is the model trained. Tensors go in
    buckets of one dtype, one broadcast per bucket (as DDP syncs module states), not one per tensor: a model has
    hundreds of parameters and buffers, and each collective has its own latency; a bucket of at most
    ``bucket_bytes`` (or one larger tensor) bounds the extra memory."""
    import torch.distributed as dist

    def send(bucket: list[torch.Tensor]) -> None:
        if len(bucket) == 1 and bucket[0].is_contiguous():  # a collective takes a contiguous tensor as it is
            dist.broadcast(bucket[0], src=0)
            return
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=0)
        for tensor, synced in zip(bucket, flat.split([t.numel() for t in bucket])):
            tensor.copy_(synced.view_as(tensor))

    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor.data)
    with torch.no_grad():
        for tensors in by_kind.values():  # the same order on every rank: the module's
            bucket, size = [], 0
            for tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    send(bucket)
                    bucket, size = [], 0
                bucket.append(tensor)
                size += nbytes
            send(bucket)


def dp_mesh(layout: Any, plan: Any) -> Any:
    """The mesh data parallelism shards / replicates over (``topology.mesh.MeshLayout.dp_mesh``; ``layout`` is
    one built for a plan of ``plan``'s shape): 2-D for HSDP (and DDP as HSDP with shard groups of one), else the shard
    dimension; with cp, over data-parallel x cp ranks."""
    return layout.dp_mesh(plan)
