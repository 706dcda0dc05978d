"""The sequence collectives SP (``parallel.tp_comm``, over the TP group) and CP (``parallel.context``, over the cp
group) share: all-gather and reduce-scatter of a tensor along one dim, the ranks' parts in rank order."""

from __future__ import annotations

from typing import Any, Callable

import torch


def all_gather_along(x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    """The ``size`` ranks' ``x`` concatenated along ``dim``, in rank order."""
    return start_all_gather_along(x, dim, group, size)()


def start_all_gather_along(x: torch.Tensor, dim: int, group: Any, size: int) -> Callable[[], torch.Tensor]:
    """``all_gather_along`` launched asynchronously: returns the function that waits for it and gives the result
    (SP's backward re-gather runs it beside the input-gradient matmul)."""
    import torch.distributed as dist

    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    work = dist.all_gather_into_tensor(out, front, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out.movedim(0, dim).contiguous()  # model code views the gathered hidden states

    return wait


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    """This rank's part (along ``dim``, rank order) of the sum of ``x`` over the group."""
    import torch.distributed as dist

    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def all_to_all_along(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any, size: int) -> torch.Tensor:
    """``x`` cut into ``size`` parts along ``scatter_dim``, part ``j`` sent to rank ``j``; the parts received
    concatenated along ``gather_dim`` in rank order (one ``all_to_all_single``; the reverse exchange is the same
    call with the two dims swapped). CP's head flavour (``parallel.context_heads``) exchanges sequence for heads."""
    import torch.distributed as dist

    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    parts = x.unflatten(scatter_dim, (size, x.shape[scatter_dim] // size)).movedim(scatter_dim, 0).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
