"""Megatron's f and g over the TP group, and sequence parallelism's collectives along the sequence (over the TP
group, ``parallel.sequence``): the autograd functions ``parallel.tensor``'s ``LocalShard`` hooks, the fused 3-D
experts' hooks (``parallel.tp_experts``) and SP's hooks run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_autopar.errors import ConfigError


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the TP group (each rank's column
    shard contributed part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward sums the row shards' partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass(frozen=True)
class SeqComm:
    """The TP group as sequence parallelism uses it (``parallel.sequence``): ``group`` None simulates the
    collectives shape-wise for a meta dry run (gather = ``tp`` copies concatenated, split = chunk 0)."""

    group: Any
    tp: int
    rank: int = 0


def _all_gather_seq(x: torch.Tensor, comm: SeqComm) -> torch.Tensor:
    """The TP ranks' pieces of ``x`` concatenated along the sequence dim (1), in rank order."""
    if comm.group is None:
        return torch.cat([x] * comm.tp, 1)
    from lightning_autopar.parallel.collectives import all_gather_along

    return all_gather_along(x, 1, comm.group, comm.tp)


def _split_seq(x: torch.Tensor, comm: SeqComm, summed: bool) -> torch.Tensor:
    """This rank's chunk of ``x`` along the sequence dim (1); ``summed``: of the sum of ``x`` over the TP group (a
    reduce-scatter)."""
    if comm.group is None:
        return x.chunk(comm.tp, 1)[0]
    if not summed:
        return x.chunk(comm.tp, 1)[comm.rank].contiguous()
    from lightning_autopar.parallel.collectives import reduce_scatter_along

    return reduce_scatter_along(x, 1, comm.group, comm.tp)


class GatherSeq(torch.autograd.Function):
    """Forward: all-gather along the sequence dim. Backward: this rank's chunk of the gradient, summed over the TP
    group (``summed_grad``: each rank's gradient is a partial sum, as after column projections without f) or
    not (the gradient is the same on every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: SeqComm, summed_grad: bool) -> torch.Tensor:
        ctx.comm, ctx.summed = comm, summed_grad
        return _all_gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_seq(grad, ctx.comm, ctx.summed), None, None


class SplitSeq(torch.autograd.Function):
    """Forward: this rank's chunk along the sequence dim (``summed``: of the sum over the TP group, a
    reduce-scatter). Backward: all-gather of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: SeqComm, summed: bool) -> torch.Tensor:
        ctx.comm = comm
        return _split_seq(x, comm, summed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.comm), None, None


def row_output_sp(output: torch.Tensor, comm: SeqComm, where: str) -> torch.Tensor:
    """A row-parallel projection's partial output [B, S, H] reduce-scattered to this rank's tokens [B, S/tp, H]
    (Megatron SP's g-bar; backward all-gather)."""
    if output.dim() != 3 or output.shape[1] % comm.tp:
        raise ConfigError("plan.sp", f"{where}: output {tuple(output.shape)} is not [batch, seq, hidden] with the "
                          f"sequence divisible by tp={comm.tp}", "use sp=false")
    return SplitSeq.apply(output, comm, True)


class SliceOfReplicated(torch.autograd.Function):
    """This rank's slice of a TP-replicated tensor (a fused bias); backward sums the ranks' slice gradients, so
    every rank's replicated gradient is the full, identical one."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, index: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.shape = group, full.shape
        ctx.save_for_backward(index)
        return full.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        (index,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape).index_copy_(0, index, grad.contiguous())
        dist.all_reduce(full, group=ctx.group)
        return full, None, None
