"""BatchNorm under data parallelism: statistics over the data-parallel group, so training equals one device.

Why: a BatchNorm layer normalises with the mean and variance of the micro-batch it sees. Under data parallelism
each rank sees only its slice, so plain per-rank statistics (and running buffers) differ from one device running
the whole micro-batch. torch's ``SyncBatchNorm`` fixes that on CUDA only (it refuses CPU tensors), so this module
builds the same from collectives:

* count-weighted: ranks may hold different row counts; the global count is summed with the sums;
* numerically careful: the global mean first, then the centred second moment ``sum((x - mean)^2)`` (no
  ``E[x^2] - E[x]^2`` cancellation);
* differentiable: an autograd all-reduce (sum forward, sum of gradients backward) carries gradients back to
  every rank's rows, so the gradient of the (dp-averaged) loss equals one device's;
* running buffers as ``_BatchNorm`` updates them: ``num_batches_tracked`` += 1, factor ``momentum`` (or the
  cumulative average ``1 / num_batches_tracked`` when ``momentum`` is None), running variance unbiased with the
  *global* count;
* eval mode with running statistics is untouched (the module's own forward); without running statistics
  (``track_running_stats=False``) eval uses batch statistics, synchronised too;
* activation recomputation re-runs a checkpointed unit's forward inside backward: the statistics are recomputed
  (the same values) but the running buffers are not updated a second time;
* gradients of its own: where a rank's input has one value per channel (one row on a 1x1 map), the affine
  ``out * weight + bias`` needs no reduction for ``bias`` and autograd hands the output's gradient itself to it
  (a view, which AccumulateGrad keeps as ``.grad``). Two such layers summed (a residual block's branch and
  shortcut) then share one ``.grad`` tensor, and the next micro-batch's accumulation adds into both twice. The
  bias's gradient is copied (``_own_grad``), as one device's batch-norm kernel returns it;
* a zero-weight stand-in (a rank with no rows of a small batch runs row 0 so every collective is entered;
  ``runtime.batches``) contributes count 0 and sums 0 while ``parallel.stand_in.standing_in(True)`` is active,
  so statistics and running buffers are those of the real rows, as on one device. A recomputed forward uses the
  flag its module saw in its last forward outside backward (the runtime runs each micro-batch's backward before
  the next forward).

Conversion is in place (``sync_batchnorm``): each BatchNorm module's class becomes a subclass with this forward,
so parameter and buffer names, the state dict and every reference to the module stay the user's (a state dict
loads into the single-device model). Applied before recompute and FSDP (``parallel.apply``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_autopar.parallel.stand_in import in_backward, stand_in_for

_SYNCED: dict[type, type] = {}


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; its backward sums the gradients over the group (every rank's output used them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)


class _OwnGrad(torch.autograd.Function):
    """Identity whose backward returns a copy of the gradient: the parameter behind it gets a ``.grad`` no other
    tensor shares (see the module doc, "gradients of its own")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _group_stats(x: torch.Tensor, group: Any, keep: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, global count) per channel of ``x`` (N, C, *) over every rank of ``group``; this
    rank's count and sums are multiplied by ``keep`` (0: a stand-in, counted as no rows)."""
    dims = [0, *range(2, x.dim())]
    # the sums travel in float64: exact counts beyond 2**24 elements, no loss adding ranks' partial sums
    count = torch.tensor([x.numel() // x.shape[1] * keep], dtype=torch.float64, device=x.device)
    summed = all_reduce(torch.cat([x.sum(dims).double() * keep, count]), group=group)
    total = summed[-1:].detach()
    mean = (summed[:-1] / total).to(x.dtype)
    shape = [1, -1] + [1] * (x.dim() - 2)
    centred = all_reduce(((x - mean.reshape(shape)) ** 2).sum(dims).double() * keep, group=group)
    return mean, (centred / total).to(x.dtype), total


class SyncedBatchNorm:
    """Mixin placed before a ``_BatchNorm`` class (``sync_batchnorm``): the synchronised forward of the module doc;
    ``_dp_group`` is the data-parallel process group the statistics are summed over."""

    _dp_group: Any = None
    _stand_in_seen = False  # whether the last forward outside backward was a stand-in's (for recomputation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        bn: _BatchNorm = self  # type: ignore[assignment]
        batch_stats = bn.training or bn.running_mean is None
        if not batch_stats:
            return super().forward(x)  # type: ignore[misc]
        bn._check_input_dim(x)
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        mean, var, total = _group_stats(xc, self._dp_group, 0.0 if stand_in_for(self) else 1.0)
        if bn.training and bn.track_running_stats and bn.running_mean is not None and not in_backward():
            self._update_running(mean.detach(), var.detach(), total)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (xc - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + bn.eps)
        if bn.affine:
            out = out * bn.weight.to(compute).reshape(shape) + _OwnGrad.apply(bn.bias.to(compute)).reshape(shape)
        return out.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        bn: _BatchNorm = self  # type: ignore[assignment]
        factor = 0.0 if bn.momentum is None else bn.momentum
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                factor = 1.0 / float(bn.num_batches_tracked)
        n = float(total)
        unbiased = var * (n / (n - 1)) if n > 1 else var
        bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
        bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)


def _synced_class(cls: type) -> type:
    if cls not in _SYNCED:
        _SYNCED[cls] = type(f"Synced{cls.__name__}", (SyncedBatchNorm, cls), {"__module__": __name__})
    return _SYNCED[cls]


def batchnorm_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm layers under ``root`` (any ``_BatchNorm``: BatchNorm1d/2d/3d, lazy ones, subclasses)."""
    return [(n, m) for n, m in root.named_modules() if isinstance(m, _BatchNorm)]


def sync_batchnorm(root: nn.Module, group: Any) -> list[str]:
    """Make every BatchNorm layer under ``root`` compute its training statistics over ``group`` (the
    data-parallel ranks), in place; returns their names. Idempotent."""
    names = []
    for name, module in batchnorm_modules(root):
        if not isinstance(module, SyncedBatchNorm):
            module.__class__ = _synced_class(type(module))
        module._dp_group = group
        names.append(name)
    return names
