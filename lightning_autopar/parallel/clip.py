"""Gradient-norm clipping over gradients that live on different meshes (TP DTensors, FSDP DTensors, plain)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch


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
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm([n.float() for n in norms], norm_type)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` but safe when gradients are DTensors on several meshes."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
