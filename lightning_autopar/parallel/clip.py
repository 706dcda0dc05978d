"""Gradient-norm clipping over gradients that live on different meshes (TP DTensors, FSDP DTensors, plain)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Sequence

import torch

Part = tuple[Callable[[torch.nn.Parameter], bool], Sequence]


def total_grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as one vector, each mesh's part reduced on its own mesh, then combined."""
    from torch.distributed.tensor import DTensor

    groups: dict = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    norms = []
    for mesh, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(_reduced(norm) if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm([n.float().to(norms[0].device) for n in norms], norm_type)


def _reduced(norm: torch.Tensor) -> torch.Tensor:
    """A DTensor norm reduced over its mesh. Gradients offloaded to the host (plan.offload=params) are CPU-local
    DTensors on an accelerator mesh; their partial norm goes to the mesh's device first, where its collective
    runs (NCCL does not take CPU tensors)."""
    from torch.distributed.tensor import DTensor

    local = norm.to_local()
    if local.device.type != norm.device_mesh.device_type:
        norm = DTensor.from_local(local.to(norm.device_mesh.device_type), norm.device_mesh, norm.placements,
                                  run_check=False)
    return norm.full_tensor()


def partitioned_grad_norm(parameters: Iterable[torch.nn.Parameter], parts: Sequence[Part],
                          norm_type: float = 2.0) -> torch.Tensor:
    """The norm over parameters spread over ranks: each part (``(predicate, groups)``, a parameter goes to the
    first part whose predicate holds) has its norm taken as in ``total_grad_norm``, then combined over its
    process groups, whose ranks hold disjoint parameters (pipeline stages, expert-parallel ranks). Every rank
    must pass the same parts."""
    import torch.distributed as dist

    params = [p for p in parameters if p.grad is not None]
    buckets: list[list[torch.nn.Parameter]] = [[] for _ in parts]
    for p in params:
        buckets[next(i for i, (pred, _) in enumerate(parts) if pred(p))].append(p)
    inf = norm_type == float("inf")
    norms = []
    for (_, groups), bucket in zip(parts, buckets):
        norm = total_grad_norm(bucket, norm_type).float()
        value = norm if inf else norm ** norm_type
        for group in groups:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        norms.append(value if inf else value ** (1.0 / norm_type))
    return torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.zeros(())


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    parts: Sequence[Part] | None = None) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` but safe when gradients are DTensors on several meshes, and (with
    ``parts``, see ``partitioned_grad_norm``) when ranks hold different parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = partitioned_grad_norm(params, parts, norm_type) if parts else total_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
