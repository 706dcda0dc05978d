"""Megatron's f and g over the TP group, and sequence parallelism's collectives along the sequence (over the TP
group, ``parallel.sequence``): the autograd functions ``parallel.tensor``'s ``LocalShard`` hooks, the fused 3-D
experts' hooks (``parallel.tp_experts``) and SP's hooks run; and the hooks summing a replicated parameter's
gradient over the TP group where each rank's use of it sees only its part (``sum_grads_pre`` / ``_post``: SP's
norms on a sequence chunk, a per-head norm on the local heads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

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


class Regather:
    """The backward re-gather of one gathered sequence, shared by the column projections that read it (q, k, v;
    gate and up): the first to run its backward launches the all-gather of the saved local chunk, each waits for
    it once (``uses`` counts them, from forward), and the last drops it."""

    def __init__(self, comm: SeqComm) -> None:
        self.comm, self.uses = comm, 0
        self._wait: Any = None
        self._full: torch.Tensor | None = None

    def start(self, local: torch.Tensor) -> None:
        if self._full is None and self._wait is None:
            if self.comm.group is None:
                self._full = _all_gather_seq(local, self.comm)
            else:
                from lightning_autopar.parallel.collectives import start_all_gather_along

                self._wait = start_all_gather_along(local, 1, self.comm.group, self.comm.tp)

    def take(self) -> torch.Tensor:
        """The whole sequence (after ``start``); one call per use."""
        if self._full is None:
            self._full, self._wait = self._wait(), None
        full = self._full
        self.release()
        return full

    def release(self) -> None:
        self.uses -= 1
        if self.uses <= 0:
            self._full = None


@dataclass
class SeqChunk:
    """Tagged on a sequence SP gathered for the attention / dense MLP (``GATHERED``): the rank's ``local`` chunk
    it came from and its shared ``Regather``; ``casts``: ``local`` in an autocast dtype, made once."""

    local: torch.Tensor
    regather: Regather
    casts: dict = field(default_factory=dict)

    @staticmethod
    def tag(gathered: torch.Tensor, local: torch.Tensor, comm: SeqComm) -> torch.Tensor:
        """``gathered`` (all-gathered from ``local``), tagged for ``keep_chunk_forward``."""
        setattr(gathered, GATHERED, SeqChunk(local.detach(), Regather(comm)))
        return gathered

    def local_as(self, dtype: torch.dtype) -> torch.Tensor:
        if self.local.dtype == dtype:
            return self.local
        if dtype not in self.casts:
            self.casts[dtype] = self.local.to(dtype)
        return self.casts[dtype]


GATHERED = "_autopar_sp_chunk"


class ColumnFromChunk(torch.autograd.Function):
    """A column projection (``x @ W.T + b``, or ``x @ W + b`` for a ``transposed`` [in, out] weight) of the
    gathered sequence ``x`` that saves only this rank's chunk ``local`` of it (Megatron SP, Korthikanti et al.
    2022 s.4.2.2; Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication): backward all-gathers the chunk
    again (shared by the module's column projections, ``Regather``) while it computes the input gradient, then the
    weight gradient. The input gradient is this rank's partial sum; the gather's backward reduce-scatters it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, local: torch.Tensor, regather: Regather, weight: torch.Tensor,
                bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
        ctx.regather, ctx.transposed, ctx.bias = regather, transposed, bias is not None
        regather.uses += 1
        ctx.save_for_backward(local, weight)
        if not transposed:
            return torch.nn.functional.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])  # HF Conv1D's own computation
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(*x.shape[:-1], weight.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local, weight = ctx.saved_tensors
        needs_weight = ctx.needs_input_grad[3]
        if needs_weight:
            ctx.regather.start(local)
        grad_x = (grad @ (weight.t() if ctx.transposed else weight)) if ctx.needs_input_grad[0] else None
        if not needs_weight:
            ctx.regather.release()
            return grad_x, None, None, None, None, None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        full = ctx.regather.take()
        flat_x = full.reshape(-1, full.shape[-1])
        grad_w = flat_x.t() @ flat_grad if ctx.transposed else flat_grad.t() @ flat_x
        grad_b = flat_grad.sum(0) if ctx.bias and ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_w, grad_b, None


def keep_chunk_forward(module: torch.nn.Module, transposed: bool) -> None:
    """Make ``module`` (an SP column projection: an nn.Linear, or HF's Conv1D with ``transposed``) compute a
    gathered input (tagged ``GATHERED``) with ``ColumnFromChunk``, so autograd keeps this rank's chunk and not
    the gathered sequence. Under autocast the operands are cast first, as autocast's linear would."""
    original = module.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        chunk = getattr(x, GATHERED, None)
        if chunk is None or args or kwargs or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return original(x, *args, **kwargs)
        weight, bias = module.weight, module.bias
        local, device = chunk.local, x.device.type
        if not torch.is_autocast_enabled(device):
            return ColumnFromChunk.apply(x, local, chunk.regather, weight, bias, transposed)
        dtype = torch.get_autocast_dtype(device)
        cast = (lambda t: t if t is None or not t.is_floating_point() else t.to(dtype))  # noqa: E731
        with torch.autocast(device, enabled=False):
            return ColumnFromChunk.apply(cast(x), chunk.local_as(dtype), chunk.regather, cast(weight), cast(bias),
                                         transposed)

    module.forward = forward


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


def sum_grads_pre(group: Any) -> Callable:
    """Swap ``module``'s own parameters for ``CopyToTP`` of them for this call (their gradient, from this rank's
    tokens or heads only, summed over the TP group)."""
    from lightning_autopar.parallel.dtensor_private import own_parameters

    def hook(module: nn.Module, args: tuple) -> None:
        params = own_parameters(module)
        stash = {n: p for n, p in params.items() if p is not None and p.requires_grad}
        params.update({n: CopyToTP.apply(p, group) for n, p in stash.items()})
        module._sp_stash = (stash, {n: params[n] for n in stash})

    return hook


def sum_grads_post(module: nn.Module, args: tuple, output: Any) -> None:
    """Undo ``sum_grads_pre``, except where something else (FSDP's reshard) already replaced the parameter."""
    from lightning_autopar.parallel.dtensor_private import own_parameters

    stash, swapped = getattr(module, "_sp_stash", ({}, {}))
    for name, param in stash.items():
        if own_parameters(module).get(name) is swapped[name]:
            own_parameters(module)[name] = param
    module._sp_stash = ({}, {})
