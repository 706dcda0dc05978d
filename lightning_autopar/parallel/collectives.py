"""The sequence collectives SP (``parallel.tp_comm``, over the TP group) and CP (``parallel.context``, over the cp
group) share: all-gather and reduce-scatter of a tensor along one dim, the ranks' parts in rank order."""

from __future__ import annotations

from typing import Any

import torch


def all_gather_along(x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    """The ``size`` ranks' ``x`` concatenated along ``dim``, in rank order."""
    import torch.distributed as dist

    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # model code views the gathered hidden states


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    """This rank's part (along ``dim``, rank order) of the sum of ``x`` over the group."""
    import torch.distributed as dist

    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()
